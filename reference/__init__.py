"""Independent pure-NumPy reference (placeholder)."""
