"""Reading a DCP checkpoint's ``.metadata`` without running anything a file can name.

DCP writes its metadata with pickle, and pickle is a program: a GLOBAL opcode names any
importable callable (protocol 4 even resolves dotted names, walking attributes from a
module to, say, ``torch.os.system``), and REDUCE, NEWOBJ and BUILD call what it named.
So the metadata of a checkpoint in a run directory, which anyone who can write there can
plant, is read here by an unpickler that

- resolves only the exact ``(module, name)`` pairs of ``ALLOWED``: the metadata
  dataclasses, ``torch.Size``, torch dtypes by their plain name, the layout lookup, paths
  (DCP records the checkpoint's path) — no dotted names, no attribute walks, no modules;
- refuses persistent ids and extension codes;
- reads at most ``MAX_METADATA_BYTES``;

and the result is then checked as data (``check_metadata``): every object of exactly its
expected class with exactly its fields (a BUILD cannot add ``__setstate__`` or anything
else), every storage entry a plain file name in the checkpoint directory with its byte
range inside that file, every chunk inside its tensor, tensor sizes bounded. A planted
file can therefore make a load fail, with one line naming it, and never run code or make
the loader read outside the directory or allocate what the file merely claims.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

from knapray.limits import MAX_METADATA_NODES, MAX_PICKLE_DEPTH, MAX_PICKLE_OPS, MAX_PICKLE_REFS

MAX_METADATA_BYTES = 256 << 20
"""A 12B model sharded over 64 ranks with its optimizer state has ~30 MB of metadata."""
MAX_NUMEL = 1 << 40
"""Elements of any one tensor a checkpoint may describe (a 12B model's largest is ~10^8)."""

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
ALLOWED: dict[tuple[str, str], Any] = {
    (_MD, "Metadata"): dcp_md.Metadata,
    (_MD, "TensorStorageMetadata"): dcp_md.TensorStorageMetadata,
    (_MD, "BytesStorageMetadata"): dcp_md.BytesStorageMetadata,
    (_MD, "ChunkStorageMetadata"): dcp_md.ChunkStorageMetadata,
    (_MD, "TensorProperties"): dcp_md.TensorProperties,
    (_MD, "MetadataIndex"): dcp_md.MetadataIndex,
    (_MD, "StorageMeta"): dcp_md.StorageMeta,
    (_MD, "_MEM_FORMAT_ENCODING"): dcp_md._MEM_FORMAT_ENCODING,
    (_FS, "_StorageInfo"): dcp_fs._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a table lookup by name
    ("pathlib", "PosixPath"): __import__("pathlib").PosixPath,
    ("pathlib", "PurePosixPath"): __import__("pathlib").PurePosixPath,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
}
"""Every global a DCP ``.metadata`` written by torch 2.10–2.13 refers to (checked by
pickling real metadata), resolved from this table: nothing is imported or looked up."""
_BUILDABLE = frozenset(v for v in ALLOWED.values() if dataclasses.is_dataclass(v) or v is dcp_fs._StorageInfo)
"""Classes whose instances a BUILD may give their state (the dataclasses DCP pickles)."""
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class UnsafeMetadata(ValueError):
    """The metadata names something a DCP checkpoint never holds, or does not hold what its
    structure promises; the message says what, in one line."""


class _Unpickler(pickle._Unpickler):
    """pickle's Python unpickler (its opcodes can be watched one by one, which the C one's
    cannot) with every opcode counted, nesting and memo reads bounded (``knapray.limits``),
    and BUILD applied only to an instance of an allowed class that this unpickler made:
    never to a class (a BUILD aimed at ``Metadata`` would set its ``__reduce_ex__`` in
    the reading process before any check ran)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.ops = 0
        self.refs = 0
        self.made: list[Any] = []  # kept alive: their ids identify what BUILD may touch
        self.made_ids: set[int] = set()

    def _made_by(op: Callable) -> Callable:  # noqa: N805 - a decorator over the dispatch table
        def run(self: "_Unpickler") -> None:
            op(self)
            self.made.append(self.stack[-1])
            self.made_ids.add(id(self.stack[-1]))
        return run

    def _ref(op: Callable) -> Callable:  # noqa: N805
        def run(self: "_Unpickler") -> None:
            self.refs += 1
            if self.refs > MAX_PICKLE_REFS:
                raise UnsafeMetadata(f"it refers back to shared objects more than {MAX_PICKLE_REFS} times")
            op(self)
        return run

    def _build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if isinstance(inst, type) or type(inst) not in _BUILDABLE or id(inst) not in self.made_ids:
            raise UnsafeMetadata(f"it sets the state of {inst!r:.80}, which DCP metadata never does (only of the "
                                 "metadata objects it creates)")
        if "__setstate__" not in vars(type(inst)):  # the default: instance attributes set from dicts
            slots = state[1] if isinstance(state, tuple) and len(state) == 2 else None
            fields = state[0] if isinstance(state, tuple) and len(state) == 2 else state
            for part in (fields, slots):
                if part is None:
                    continue
                bad = [k for k in part if not isinstance(k, str) or k.startswith("__")] \
                    if type(part) is dict else [type(part).__name__]
                if bad:
                    raise UnsafeMetadata(f"it sets {type(inst).__name__}'s {bad[:3]!r}, which DCP metadata never does")
        pickle._Unpickler.dispatch[pickle.BUILD[0]](self)

    def _counted(op: Callable) -> Callable:  # noqa: N805
        def run(self: "_Unpickler") -> None:
            self.ops += 1
            if self.ops > MAX_PICKLE_OPS:
                raise UnsafeMetadata(f"it holds more than {MAX_PICKLE_OPS} objects, more than DCP metadata of any "
                                     "model")
            op(self)
            if len(self.metastack) > MAX_PICKLE_DEPTH:
                raise UnsafeMetadata(f"it nests containers more than {MAX_PICKLE_DEPTH} deep; DCP's nest a few levels")
        return run

    for _code in (pickle.NEWOBJ, pickle.NEWOBJ_EX, pickle.REDUCE, pickle.OBJ, pickle.INST):
        dispatch[_code[0]] = _made_by(dispatch[_code[0]])
    for _code in (pickle.GET, pickle.BINGET, pickle.LONG_BINGET):
        dispatch[_code[0]] = _ref(dispatch[_code[0]])
    dispatch[pickle.BUILD[0]] = _build
    for _key, _op in list(dispatch.items()):  # (a loop: a comprehension cannot see this class body)
        dispatch[_key] = _counted(_op)
    del _code, _key, _op

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return ALLOWED[module, name]
        if module == "torch" and name in _DTYPES:  # how a torch.dtype pickles itself
            return _DTYPES[name]
        raise UnsafeMetadata(f"it refers to {module}.{name}, which DCP metadata never holds")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadata("it holds a persistent id, which DCP metadata never does")


def read_metadata(path: str) -> dcp_md.Metadata:
    """The checked metadata in the file ``path`` (a checkpoint directory's ``.metadata``);
    raises ``UnsafeMetadata`` (or OSError) without running anything the file names."""
    size = os.path.getsize(path)
    if size > MAX_METADATA_BYTES:
        raise UnsafeMetadata(f"it is {size} bytes, more than the {MAX_METADATA_BYTES} any checkpoint's metadata needs")
    with open(path, "rb") as f:
        data = f.read(MAX_METADATA_BYTES + 1)
    try:
        metadata = _Unpickler(io.BytesIO(data)).load()
    except UnsafeMetadata:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or garbage pickles raise many kinds
        raise UnsafeMetadata(f"it is not readable DCP metadata ({type(e).__name__}: {e})") from None
    check_metadata(metadata, os.path.dirname(path))
    return metadata


# ---- the structure, checked as data ---------------------------------------------------------


def _fields(obj: Any, cls: type, where: str) -> None:
    """``obj`` is exactly a ``cls`` whose instance attributes are its dataclass fields."""
    if type(obj) is not cls:
        raise UnsafeMetadata(f"{where} is a {type(obj).__name__}, not a {cls.__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    extra = set(vars(obj)) - names
    if extra:
        raise UnsafeMetadata(f"{where} has attributes {sorted(map(str, extra))[:3]} that {cls.__name__} does not")


def _int(value: Any, where: str, lo: int = 0, hi: int | None = None) -> int:
    if type(value) is not int or value < lo or (hi is not None and value > hi):
        raise UnsafeMetadata(f"{where} is {value!r}, not an int in [{lo}, {hi if hi is not None else 'inf'}]")
    return value


def _size(value: Any, where: str) -> tuple[int, ...]:
    if type(value) is not torch.Size:
        raise UnsafeMetadata(f"{where} is a {type(value).__name__}, not a torch.Size")
    dims = tuple(_int(d, where) for d in value)
    numel = 1
    for d in dims:
        numel *= d
    if numel > MAX_NUMEL:
        raise UnsafeMetadata(f"{where} {list(dims)} has {numel} elements, more than any model's tensor")
    return dims


def _str(value: Any, where: str, optional: bool = True) -> None:
    if not (isinstance(value, str) or (optional and value is None)):
        raise UnsafeMetadata(f"{where} is a {type(value).__name__}, not a string")


def _tensor(md: Any, where: str) -> None:
    _fields(md, dcp_md.TensorStorageMetadata, where)
    _fields(md.properties, dcp_md.TensorProperties, f"{where}.properties")
    if not isinstance(md.properties.dtype, torch.dtype):
        raise UnsafeMetadata(f"{where}.properties.dtype is not a torch dtype")
    size = _size(md.size, f"{where}.size")
    if type(md.chunks) is not list:
        raise UnsafeMetadata(f"{where}.chunks is a {type(md.chunks).__name__}, not a list")
    for i, chunk in enumerate(md.chunks):
        at = f"{where}.chunks[{i}]"
        _fields(chunk, dcp_md.ChunkStorageMetadata, at)
        offsets, sizes = _size(chunk.offsets, f"{at}.offsets"), _size(chunk.sizes, f"{at}.sizes")
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
            o + s > n for o, s, n in zip(offsets, sizes, size)
        ):
            raise UnsafeMetadata(f"{at} (offsets {list(offsets)}, sizes {list(sizes)}) lies outside the tensor's "
                                 f"size {list(size)}")


def _plain(value: Any, where: str) -> None:
    """Plain data only: str, int, float, bool, None, and lists/tuples/dicts of them. Each
    container is visited once however often it is shared, and the tree it stands for, its
    shared parts counted as often as they are referred to (what any reader walking it
    walks), may hold at most ``MAX_METADATA_NODES`` values: 64 references to one list, 12
    levels deep, would stand for 64^12."""
    expanded: dict[int, int] = {}  # id -> values in the tree below it, shared parts repeated
    todo: list[tuple[Any, int, bool]] = [(value, 0, False)]
    while todo:
        v, depth, children_done = todo.pop()
        if v is None or type(v) in (str, int, float, bool):
            continue
        if type(v) not in (list, tuple, dict):
            raise UnsafeMetadata(f"{where} holds a {type(v).__name__}, not plain data")
        if depth > 16:
            raise UnsafeMetadata(f"{where} is nested deeper than DCP's planner data ever is")
        items = [x for kv in v.items() for x in kv] if type(v) is dict else v
        if children_done:
            expanded[id(v)] = 1 + sum(expanded.get(id(x), 1) for x in items)
            if expanded[id(v)] > MAX_METADATA_NODES:
                raise UnsafeMetadata(f"{where} stands for more than {MAX_METADATA_NODES} values once its shared "
                                     "parts are expanded; DCP's planner data is a small table")
            continue
        if id(v) in expanded:
            continue
        expanded[id(v)] = 0  # on the path: a cycle cannot be pickled as plain data, and is not walked twice
        todo.append((v, depth, True))
        todo.extend((x, depth + 1, False) for x in items)


def check_metadata(metadata: Any, directory: str) -> None:
    """Raise ``UnsafeMetadata`` unless ``metadata`` is DCP metadata as DCP writes it, whose
    storage entries are byte ranges inside files of ``directory``."""
    _fields(metadata, dcp_md.Metadata, "the metadata")
    if type(metadata.state_dict_metadata) is not dict:
        raise UnsafeMetadata("its state_dict_metadata is not a dict")
    for key, md in metadata.state_dict_metadata.items():
        _str(key, "a state dict key", optional=False)
        if type(md) is dcp_md.BytesStorageMetadata:
            _fields(md, dcp_md.BytesStorageMetadata, key)
        else:
            _tensor(md, key)
    _plain(metadata.planner_data, "planner_data")
    _str(metadata.version, "version")
    if metadata.storage_meta is not None:
        sm = metadata.storage_meta
        _fields(sm, dcp_md.StorageMeta, "storage_meta")
        if not (sm.checkpoint_id is None or isinstance(sm.checkpoint_id, (str, os.PathLike))):
            raise UnsafeMetadata("storage_meta.checkpoint_id is not a path")
        _str(sm.save_id, "storage_meta.save_id")
        _str(sm.load_id, "storage_meta.load_id")
        _plain(sm.modules, "storage_meta.modules")
    storage = metadata.storage_data
    if storage is None:
        return
    if type(storage) is not dict:
        raise UnsafeMetadata("its storage_data is not a dict")
    file_sizes: dict[str, int] = {}
    for index, info in storage.items():
        _fields(index, dcp_md.MetadataIndex, "a storage index")
        _str(index.fqn, "a storage index's fqn", optional=False)
        if index.offset is not None:
            _size(index.offset, f"{index.fqn}'s storage offset")
        where = f"the storage of {index.fqn}"
        _fields(info, dcp_fs._StorageInfo, where)
        name = info.relative_path
        if not isinstance(name, str) or not _FILE_NAME.match(name) or name in (".", ".."):
            raise UnsafeMetadata(f"{where} is in {name!r}, not a file of the checkpoint directory")
        if name not in file_sizes:
            full = os.path.join(directory, name)
            if not os.path.isfile(full):
                raise UnsafeMetadata(f"{where} is in {name}, which the checkpoint directory does not hold")
            file_sizes[name] = os.path.getsize(full)
        offset = _int(info.offset, f"{where}'s offset")
        _int(info.length, f"{where}'s length", hi=file_sizes[name] - offset)
        if getattr(info, "transform_descriptors", None):
            raise UnsafeMetadata(f"{where} names transforms {info.transform_descriptors!r}; knapray writes none")
