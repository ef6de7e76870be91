"""The ``_METADATA`` file: the tree's key paths, key types and value types.

The layout is Orbax's, so each tool reads the other's files::

    {"tree_metadata": {
       "('params', 'w')": {
         "key_metadata": [{"key": "params", "key_type": 2}, {"key": "w", "key_type": 2}],
         "value_metadata": {"value_type": "jax.Array", "skip_deserialize": false,
                            "write_shape": [4, 8], "checkpointables": {...}}},
       "('empty',)": {..., "value_metadata": {"value_type": "Dict", "skip_deserialize": true}}},
     "use_ocdbt": true, "use_zarr3": true, "store_array_data_equal_to_fill_value": true,
     "custom_metadata": null, "checkpointables": {...}}

What Orbax has no field for lives under ``"checkpointables"`` keys, which
Orbax ignores: array shapes, dtypes and chunking (so metadata and small-array
loads need no reads), Python scalar types, the leaf's own value type where
Orbax's is shared by several leaf handlers, tuple containers, the paths of
``int`` dict keys (``"int_keys"``: Orbax records every key as a string),
whether storage names are escaped, and the checksum of ``_strings.json``.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import checkpointables as cp
from etils import epath

from checkpointables_pytree.tree import _keypaths

__all__ = ["INT_KEYS", "METADATA_FILE", "Entry", "TreeMetadata", "read_tree_metadata"]

METADATA_FILE = "_METADATA"
EXTRA = "checkpointables"
# A leaf's own value type, recorded (under EXTRA) where its Orbax value_type is one a more
# general leaf handler also writes: a PRNG key is Orbax's "jax.Array", bytes its "np.ndarray".
OWN_VALUE_TYPE = "value_type"
INT_KEYS = "int_keys"
# A process-local save's (``MultiprocessingOptions(primary_host=None)`` in a job of several
# processes): ``{"process_index": i, "process_count": n}``. It holds process i's shards only.
PROCESS_LOCAL = "process_local"
_KEY_TYPES = frozenset({_keypaths.SEQUENCE, _keypaths.DICT})
FORMAT_VERSION = 1


@dataclasses.dataclass(slots=True)
class Entry:
    """One recorded leaf or empty node."""

    names: tuple[str, ...]
    key_types: tuple[int, ...]
    value_type: str
    skip_deserialize: bool = False
    write_shape: tuple[int, ...] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def is_empty_node(self) -> bool:
        """Whether this records an empty container or ``None`` rather than a leaf."""
        return self.skip_deserialize and self.value_type in _keypaths.EMPTY_TYPES

    @property
    def keystr(self) -> str:
        """The key path as users write it."""
        return _keypaths.keystr(self.names, self.key_types)

    def to_json(self) -> dict[str, Any]:
        """The entry's JSON value (its map key is ``str(self.names)``)."""
        value: dict[str, Any] = {
            "value_type": self.value_type,
            "skip_deserialize": self.skip_deserialize,
        }
        if self.write_shape is not None:
            value["write_shape"] = list(self.write_shape)
        if self.extra:
            value[EXTRA] = self.extra
        return {
            "key_metadata": [
                {"key": n, "key_type": t} for n, t in zip(self.names, self.key_types, strict=True)
            ],
            "value_metadata": value,
        }


@dataclasses.dataclass
class TreeMetadata:
    """The parsed ``_METADATA`` of one pytree directory."""

    entries: list[Entry]
    use_ocdbt: bool = True
    use_zarr3: bool = True
    tuple_paths: frozenset[tuple[str, ...]] = frozenset()
    # The key names of the paths whose last key is an int dict key (recorded as a string).
    int_keys: frozenset[tuple[str, ...]] = frozenset()
    # True for trees this library wrote: storage names escape '.', '/' and '%'.
    escaped_names: bool = True
    # Whether some entries record their own value type (OWN_VALUE_TYPE): loads of trees
    # without any look for none.
    own_value_types: bool = False
    strings_crc32c: int | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Whether the file was checked against the checksum recorded at commit (not written).
    checksum_recorded: bool = False
    # What loads derive from this text alone (storage names, stored-array records, read
    # plans), shared by every load of the same text: another text is another parse, so
    # nothing here is ever stale.
    derived: dict[Any, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # The entries as the file's text (then ``entries`` is empty): what a save writes, built
    # from its structure's templates (``_save_plan.saved_tree_metadata``).
    entries_text: str | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def process_local(self) -> tuple[int, int] | None:
        """``(process index, process count)`` of the process that saved this tree on its own
        (process-local storage), holding its own shards of global arrays only; else ``None``."""
        record = self.extra.get(PROCESS_LOCAL)
        if not isinstance(record, dict):
            return None
        index, count = record.get("process_index"), record.get("process_count")
        if type(index) is not int or type(count) is not int:
            return None
        return index, count

    def process_local_hint(self) -> str:
        """What a missing chunk of a process-local tree means, and what to do."""
        index, count = self.process_local or (0, 0)
        return (
            f"it was saved process-locally (MultiprocessingOptions(primary_host=None)) by "
            f"process {index} of {count}, and holds only the shards of global arrays that "
            f"process's devices held: not damage. Restore it in a job of {count} processes, "
            f"on process {index}, with the same sharding (an abstract tree with the saved "
            f"arrays' shardings), or load only its other leaves (cp.PLACEHOLDER, partial_load)"
        )

    def to_json_text(self) -> str:
        """The text of the ``_METADATA`` file."""
        extra = dict(self.extra)
        extra["format_version"] = FORMAT_VERSION
        extra["escaped_names"] = self.escaped_names
        if self.tuple_paths:
            extra["tuples"] = [list(p) for p in sorted(self.tuple_paths)]
        extra.pop(INT_KEYS, None)
        if self.int_keys:
            extra[INT_KEYS] = [list(p) for p in sorted(self.int_keys)]
        if self.strings_crc32c is not None:
            extra["strings_crc32c"] = self.strings_crc32c
        if self.own_value_types:
            extra["own_value_types"] = True
        document = {
            "tree_metadata": {},
            "use_ocdbt": self.use_ocdbt,
            "use_zarr3": self.use_zarr3,
            "store_array_data_equal_to_fill_value": True,
            "custom_metadata": None,
            EXTRA: extra,
        }
        # The same text as json.dumps(document with every entry's to_json()), written
        # entry by entry: building 5,000 entries' dicts first took as long as encoding them.
        rest = _ENCODER.encode(document)
        prefix = '{"tree_metadata":{}'
        assert rest.startswith(prefix)
        entries = self.entries_text
        if entries is None:
            encode = compact_encoder()
            entries = ",".join([_entry_text(e, encode) for e in self.entries])
        return '{"tree_metadata":{' + entries + "}" + rest[len(prefix) :]

    def storage_name(self, names: Sequence[str]) -> str:
        """The name a leaf's array is stored under."""
        if self.escaped_names:
            return cp.serialization.param_name_from_keypath(names)
        return ".".join(names)  # Orbax's names: plain dot-joined keys.


_ENCODER = json.JSONEncoder(separators=(",", ":"))
_string = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]


def compact_encoder() -> Callable[[Any], str]:
    """``_ENCODER.encode`` without its per-call set-up (half the time for a small dict).

    For one document: the C encoder's record of the containers being encoded
    (to detect cycles) is only clean again after a successful call.
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # Python without the json C accelerator.
        return _ENCODER.encode
    encode = make({}, _ENCODER.default, _string, None, ":", ",", False, False, True)
    return lambda value: "".join(encode(value, 0))


def _entry_text(entry: Entry, encode: Callable[[Any], str]) -> str:
    """``"<str(names)>":<entry.to_json() as JSON>``, built directly (f-strings: one join each)."""
    head = entry_head(entry.names, entry.key_types)
    return head + entry_tail(
        entry.value_type, entry.skip_deserialize, entry.write_shape, entry.extra, encode
    )


def entry_head(
    names: tuple[str, ...],
    key_types: tuple[int, ...],
    key_texts: dict[tuple[str, int], str] | None = None,
) -> str:
    """An entry's text up to its value metadata: ``"<str(names)>":{"key_metadata":[...],...{``.

    It depends only on the tree's structure: saves keep it with the structure.
    ``key_texts`` keeps the text of each key for the next entries (siblings share most).
    """
    if len(names) != len(key_types):
        raise ValueError(f"{names}: {len(names)} key names but {len(key_types)} key types")
    if key_texts is None:
        key_texts = {}
    keys = []
    for key in zip(names, key_types):  # noqa: B905 (lengths checked above)
        text = key_texts.get(key)
        if text is None:
            text = key_texts[key] = (
                f'{{"key":{_string(key[0])}{_KEY_TYPE_TEXT.get(key[1]) or _key_type_text(key[1])}'
            )
        keys.append(text)
    return f'{_string(str(names))}:{{"key_metadata":[{",".join(keys)}],"value_metadata":{{'


def entry_tail(
    value_type: str,
    skip_deserialize: bool,
    write_shape: Sequence[int] | None,
    extra: Mapping[str, Any] | None,
    encode: Callable[[Any], str],
) -> str:
    """An entry's text after ``entry_head``: its value metadata and the closing braces."""
    skip = "true" if skip_deserialize else "false"
    shape_text = "" if write_shape is None else f',"write_shape":{encode(list(write_shape))}'
    extra_text = f',"{EXTRA}":{encode(extra)}' if extra else ""
    return (
        f'"value_type":{_string(value_type)},"skip_deserialize":{skip}{shape_text}{extra_text}}}}}'
    )


def _key_type_text(key_type: Any) -> str:
    return f',"key_type":{_ENCODER.encode(key_type)}}}'


_KEY_TYPE_TEXT = {t: _key_type_text(t) for t in (_keypaths.SEQUENCE, _keypaths.DICT)}


def entries_by_names(tree: TreeMetadata) -> dict[tuple[str, ...], Entry]:
    """``tree``'s entries by their key names (made once per text: ``tree.derived``)."""
    entries = tree.derived.get("entries")
    if entries is None:
        entries = tree.derived["entries"] = {e.names: e for e in tree.entries}
    return entries


def write_tree_metadata(directory: epath.Path, metadata: TreeMetadata) -> None:
    """Writes ``_METADATA`` (the commit fsyncs it with the rest of the checkpoint)."""
    cp.storage.write_text(directory / METADATA_FILE, metadata.to_json_text())


def _bad(path: epath.Path, what: str) -> cp.errors.MetadataError:
    return cp.errors.MetadataError(
        f"{path} is malformed: {what}. The pytree's metadata is damaged; restore the file from a "
        f"copy of the checkpoint."
    )


def _shown(text: str) -> str:
    """A key of the file, for a message: quoted, and cut short if long."""
    return repr(text) if len(text) <= 80 else repr(text[:80]) + "..."


def _parse_entry(path: epath.Path, key: str, value: Any) -> Entry:
    try:
        keys = value["key_metadata"]
        meta = value["value_metadata"]
        names = tuple([str(k["key"]) for k in keys])
        key_types = tuple([k["key_type"] for k in keys])
        value_type = meta.get("value_type")
        write_shape = meta.get("write_shape")
        extra = meta.get(EXTRA) or {}
        skip = bool(meta.get("skip_deserialize", False))
    except (TypeError, KeyError, AttributeError):
        raise _bad(
            path, f"entry {_shown(key)} lacks 'key_metadata' or 'value_metadata' entries"
        ) from None
    if not all(type(t) is int and t in _KEY_TYPES for t in key_types):
        raise _bad(
            path,
            f"entry {_shown(key)} has a malformed key (its key type is not 1 or 2)",
        )
    if _keypaths.SEQUENCE in key_types and not all(  # Checked only for trees with lists.
        # An index a list can have (JAX's key entries take a 64-bit one).
        n.isdecimal() and len(n) <= 18
        for n, t in zip(names, key_types, strict=True)
        if t == _keypaths.SEQUENCE
    ):
        raise _bad(path, f"entry {_shown(key)} has a sequence key that is not an index")
    if not isinstance(value_type, str):
        raise _bad(path, f"entry {_shown(key)} has no 'value_type'")
    if write_shape is not None and not (
        isinstance(write_shape, list) and all(type(d) is int and d >= 0 for d in write_shape)
    ):
        raise _bad(path, f"entry {_shown(key)} has a malformed 'write_shape'")
    if not isinstance(extra, dict):
        raise _bad(path, f"entry {_shown(key)} has a malformed {EXTRA!r} field")
    return Entry(
        names=names,
        key_types=key_types,
        value_type=value_type,
        skip_deserialize=skip,
        write_shape=tuple(write_shape) if write_shape is not None else None,
        extra=extra,
    )


# The parsed _METADATA of this library's recent texts: checkpoints of one tree structure
# (a training run's, one checkpoint loaded again and again) have the same text.
_PARSED: dict[str | bytes, TreeMetadata] = {}
_PARSED_KEPT = 4
_PARSED_LOCK = threading.Lock()


def parse_tree_metadata(path: epath.Path, text: str | bytes) -> TreeMetadata:
    """Parses the text (or UTF-8 bytes) of a ``_METADATA`` file at ``path``.

    A text parsed recently is not parsed again: the result is a shallow copy
    of the earlier one, sharing its entries (treat them as immutable) and its
    ``derived`` cache.

    Raises:
      cp.errors.MetadataError: the text is not the expected JSON.
    """
    parsed = _PARSED.get(text)
    if parsed is None:
        parsed = parse_tree_metadata_uncached(path, text)
        if not parsed.escaped_names:
            # Not ours: its use_ocdbt may come from the directory rather than the text.
            return parsed
        with _PARSED_LOCK:  # Loads may run in several threads.
            if len(_PARSED) >= _PARSED_KEPT:
                del _PARSED[next(iter(_PARSED))]
            _PARSED[text] = parsed
    return dataclasses.replace(parsed, extra=dict(parsed.extra))


def parse_tree_metadata_uncached(path: epath.Path, text: str | bytes) -> TreeMetadata:
    document = cp.safe_json.loads(text, source=path)
    if not isinstance(document, Mapping) or not isinstance(document.get("tree_metadata"), Mapping):
        raise _bad(path, "expected a JSON object with a 'tree_metadata' object")
    entries = [_parse_entry(path, k, v) for k, v in document["tree_metadata"].items()]
    extra = document.get(EXTRA)
    ours = isinstance(extra, Mapping)
    extra = dict(cast(Mapping[str, Any], extra)) if ours else {}  # ours: a Mapping.
    tuples = extra.get("tuples") or []
    if not isinstance(tuples, list) or not all(isinstance(t, list) for t in tuples):
        raise _bad(path, f"malformed {EXTRA!r}.tuples")
    strings_crc = extra.get("strings_crc32c")
    int_keys = _parse_int_keys(path, extra.get(INT_KEYS, []))
    use_ocdbt = document.get("use_ocdbt")
    return TreeMetadata(
        entries=entries,
        # A missing flag: Orbax then detects OCDBT by the manifest's presence.
        use_ocdbt=bool(use_ocdbt)
        if use_ocdbt is not None
        else cp.storage.exists(path.parent / "manifest.ocdbt"),
        use_zarr3=bool(document.get("use_zarr3", False)),
        tuple_paths=frozenset(tuple(str(n) for n in t) for t in tuples),
        int_keys=int_keys,
        escaped_names=bool(extra.get("escaped_names", False)) if ours else False,
        own_value_types=extra.get("own_value_types") is True,
        strings_crc32c=int(strings_crc) if isinstance(strings_crc, int) else None,
        extra=extra,
    )


def _parse_int_keys(path: epath.Path, record: Any) -> frozenset[tuple[str, ...]]:
    """The paths of int dict keys: lists of key names, each ending in an integer's name."""
    if not isinstance(record, list) or not all(
        isinstance(p, list) and p and all(isinstance(n, str) for n in p) for p in record
    ):
        raise _bad(path, f"{EXTRA!r}.{INT_KEYS} is not a list of key paths")
    for names in record:
        last = names[-1]
        try:
            is_int = str(int(last)) == last
        except ValueError:
            is_int = False
        if not is_int:
            raise _bad(path, f"{EXTRA!r}.{INT_KEYS} names the key {last!r}, not an integer")
    return frozenset(map(tuple, record))


def read_tree_metadata(directory: epath.Path) -> TreeMetadata:
    """Reads and parses ``directory/_METADATA``, checked against the checksum recorded when
    the checkpoint was committed (``cp.metadata_checksums``).

    Raises:
      cp.errors.MetadataError: the file is missing, unreadable or malformed.
      cp.errors.IntegrityError: the file does not match its recorded checksum.
    """
    path = directory / METADATA_FILE
    try:
        checked = cp.metadata_checksums.read_checked(
            path, max_bytes=cp.metadata_checksums.MAX_FILE_BYTES
        )
    except FileNotFoundError:
        raise cp.errors.MetadataError(
            f"{path} does not exist, so {directory} is not a pytree checkpointable (or it was "
            f"damaged). Check the path, or load it with the handler that saved it."
        ) from None
    except OSError as e:
        raise cp.errors.MetadataError(f"Cannot read {path}: {e}.") from e
    tree = parse_tree_metadata(path, checked.data)
    tree.checksum_recorded = checked.checked
    return tree
