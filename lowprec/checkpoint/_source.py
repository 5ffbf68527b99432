"""What a conversion reads: one safetensors file, or a sharded checkpoint folder.

A folder is given as the directory or as its ``*.safetensors.index.json`` (the Hugging
Face sharded layout: ``{"metadata": {"total_size": ...}, "weight_map": {tensor: shard}}``).
Without an index, every top-level ``*.safetensors`` file of the folder is a shard. All
other files of the folder (config, tokenizer, ...) are copied to the output folder;
symbolic links are followed to regular files inside the folder, or inside the ``blobs/``
folder of a Hugging Face cache snapshot (``<repo>/snapshots/<rev>/x -> ../../blobs/<hash>``);
a link leading anywhere else is refused by the converters unless ``follow_symlinks`` (its
target would be read, and copied into the output). Anything that is not a regular file is
skipped and listed in the report.

The input checkpoint is a folder: the folder given, or the folder holding a single
``.safetensors`` file when that folder is a model folder (it holds a ``config.json`` or a
``*.safetensors.index.json``: the file is one shard, or the one weights file, of that
checkpoint). Every existing file under it counts as an input — shards, index, config.json
(which may hold the ``quantization_config``), tokenizer files, subfolders — so an output, even
with ``--force``, can never replace one (:class:`lowprec.checkpoint._atomic.Inputs`). A file
in any other folder is a checkpoint on its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from ._atomic import TEMP_TAG, Inputs
from ._errors import CheckpointError

INDEX_SUFFIX = ".safetensors.index.json"
MAX_INDEX_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass
class Source:
    """The input of a conversion."""

    given: str
    folder: Optional[str]  # None for a single file
    shards: list  # shard file names relative to ``folder`` (single file: its path)
    index_name: Optional[str] = None  # relative to ``folder``
    index: Optional[dict] = None
    others: list = dataclasses.field(default_factory=list)  # relative paths to copy
    skipped: list = dataclasses.field(default_factory=list)  # (relative path, reason)
    inputs: Inputs = dataclasses.field(default_factory=Inputs)
    home: Optional[str] = None  # the checkpoint's folder: ``folder``, or a single file's model folder

    @property
    def is_folder(self) -> bool:
        return self.folder is not None

    def path(self, rel: str) -> str:
        return rel if self.folder is None else os.path.join(self.folder, rel)

    def other_bytes(self) -> int:
        return sum(os.stat(self.path(r)).st_size for r in self.others)


def _is_temp(name: str) -> bool:
    base = os.path.basename(name)
    return base.startswith(".") and TEMP_TAG in base


def _plain_name(name, where: str) -> str:
    if (
        not isinstance(name, str) or not name or name in (".", "..")
        or "/" in name or "\\" in name or "\0" in name
    ):
        raise CheckpointError(
            f"{where}: shard name {name!r} is not a plain file name in the checkpoint folder"
        )
    return name


def _read_index(path: str) -> dict:
    try:
        size = os.path.getsize(path)
        if size > MAX_INDEX_BYTES:
            raise CheckpointError(f"{path}: {size} bytes is too large for an index file")
        with open(path, "rb") as f:
            index = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a valid JSON index ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not a valid index (JSON nested too deeply)") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CheckpointError(f"{path}: an index needs a \"weight_map\" object (tensor -> shard)")
    for name, shard in index["weight_map"].items():
        _plain_name(shard, f"{path}: tensor {name!r}")
    if "metadata" in index and not isinstance(index["metadata"], dict):
        raise CheckpointError(f"{path}: \"metadata\" is not an object")
    return index


def _outside_link(folder: str, rel: str) -> Optional[str]:
    """The target of ``folder/rel`` if reaching it follows a symbolic link out of ``folder``
    (other than into the Hugging Face cache's ``blobs/`` of the same repository), else None."""
    full = os.path.join(folder, rel)
    target = os.path.realpath(full)
    root = os.path.realpath(folder)
    if os.path.abspath(full) == target or os.path.commonpath([root, target]) == root:
        return None
    snapshots = os.path.dirname(root)
    if os.path.basename(snapshots) == "snapshots":
        blobs = os.path.join(os.path.dirname(snapshots), "blobs")
        if os.path.commonpath([blobs, target]) == blobs:
            return None
    return target


def check_symlinks(source: "Source") -> None:
    """CheckpointError naming the first file of a folder ``source`` whose symbolic link
    leads out of the folder (see the module docstring)."""
    if not source.is_folder:
        return
    rels = [*source.shards, *([source.index_name] if source.index_name else []), *source.others]
    for rel in rels:
        target = _outside_link(source.folder, rel)
        if target is not None:
            raise CheckpointError(
                f"{os.path.join(source.folder, rel)}: is a symbolic link to {target}, outside "
                f"the input folder; refusing to read and copy it (pass --follow-symlinks / "
                "follow_symlinks=True if that file belongs to the checkpoint)"
            )


MODEL_FOLDER_FILES = ("config.json",)  # besides an index: what makes a folder a model's


def model_folder(path: str) -> Optional[str]:
    """The folder holding the file ``path`` if it is a model folder (it holds config.json or
    a ``*.safetensors.index.json``), else None."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    if any(n in MODEL_FOLDER_FILES or n.endswith(INDEX_SUFFIX) for n in names):
        return os.path.dirname(path) or "."
    return None


def open_source(path) -> Source:
    """Finds the shards, index and other files of ``path`` (a file, folder or index)."""
    given = os.fspath(path)
    if not os.path.exists(given):
        raise CheckpointError(f"{given}: no such file or folder")
    if os.path.isdir(given):
        folder = given
        names = sorted(os.listdir(folder))
        indexes = [n for n in names if n.endswith(INDEX_SUFFIX)
                   and os.path.isfile(os.path.join(folder, n))]
        if len(indexes) > 1:
            raise CheckpointError(
                f"{folder}: holds several index files ({', '.join(indexes)}); pass the one "
                "to convert instead of the folder"
            )
        index_name = indexes[0] if indexes else None
    elif given.endswith(".index.json"):
        folder, index_name = os.path.split(os.path.abspath(given))
    else:
        source = Source(given, None, [given])
        source.inputs.add(given)
        source.home = model_folder(given)
        if source.home is not None:
            source.inputs.add_folder(source.home)
        return source
    index = None
    if index_name is not None:
        index = _read_index(os.path.join(folder, index_name))
        shards = sorted(set(index["weight_map"].values()))
        for shard in shards:
            full = os.path.join(folder, shard)
            if not os.path.isfile(full):
                raise CheckpointError(
                    f"{os.path.join(folder, index_name)}: shard {shard!r} is missing from {folder}"
                )
        if not shards:
            raise CheckpointError(f"{os.path.join(folder, index_name)}: the weight_map is empty")
    else:
        shards = [n for n in sorted(os.listdir(folder)) if n.endswith(".safetensors")
                  and not _is_temp(n) and os.path.isfile(os.path.join(folder, n))]
        if not shards:
            raise CheckpointError(
                f"{folder}: no .safetensors files and no *{INDEX_SUFFIX} in this folder"
            )
    source = Source(given, folder, shards, index_name, index, home=folder)
    taken = set(shards) | ({index_name} if index_name else set())
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for d in list(dirs):
            if os.path.islink(os.path.join(root, d)):
                dirs.remove(d)
                rel = os.path.relpath(os.path.join(root, d), folder)
                source.skipped.append((rel, "symbolic link to a folder, not followed"))
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel in taken or _is_temp(name):
                continue
            full = os.path.join(root, name)
            try:
                regular = os.path.isfile(full)  # follows symbolic links
            except OSError:
                regular = False
            if regular:
                source.others.append(rel)
            else:
                source.skipped.append((rel, "not a regular file"))
    for rel in [*shards, *([index_name] if index_name else []), *source.others]:
        source.inputs.add(os.path.join(folder, rel))
    source.inputs.add_folder(folder)
    return source
