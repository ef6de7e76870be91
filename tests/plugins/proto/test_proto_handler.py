"""The proto plugin: conformance suite, the text file, and finding message types."""

from __future__ import annotations

import sys
import threading

import checkpointables as cp
import pytest
from checkpointables.testing import HandlerConformance
from checkpointables_proto import MessageTypeMismatchError, MessageTypeNotFoundError
from google.protobuf import duration_pb2, struct_pb2, text_format, timestamp_pb2

from ...metadata_edits import with_metadata_checksums_recomputed, without_metadata_checksums
from ...traced_memory import TracedPeak
from .messages import Secret, TrainConfig, train_config


def _struct() -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update({"lr": 0.001, "layers": [1, "two", None, True], "nested": {"deep": {"x": -1.5}}})
    return s


class TestProtoConformance(HandlerConformance):
    handler_name = "proto"

    def make_checkpointables(self):
        return [
            _struct(),
            duration_pb2.Duration(seconds=3600, nanos=17),
            timestamp_pb2.Timestamp(seconds=1_700_000_000, nanos=999_999_999),
            train_config(),
            struct_pb2.Struct(),  # Empty: the file holds only its header.
        ]

    def make_unhandleable(self):
        return [{"lr": 0.1}, struct_pb2.Struct, "learning_rate: 0.1", 3]

    def abstract_for(self, checkpointable):
        return type(checkpointable)

    def assert_loaded_equal(self, loaded, original):
        assert type(loaded) is type(original)
        assert loaded == original, f"loaded {loaded}, saved {original}"

    def assert_metadata_matches(self, metadata, original):
        assert metadata is type(original)


def test_file_is_text_format_with_type_header(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"config": train_config()})
    text = (tmp_path / "c" / "config" / "proto.pbtxt").read_text()
    assert text.splitlines()[:2] == [
        "# proto-file: checkpointables_test/train_config.proto",
        "# proto-message: checkpointables_test.TrainConfig",
    ]
    assert "learning_rate: 0.1" in text
    # Exactly what Orbax's ProtoHandler does to read it: the header is a comment.
    assert text_format.Parse(text, TrainConfig()) == train_config()


def test_load_without_class_finds_imported_types(tmp_path) -> None:
    saved = {"config": train_config(), "struct": _struct(), "d": duration_pb2.Duration(seconds=9)}
    cp.save_checkpointables(tmp_path / "c", saved)
    loaded = cp.load_checkpointables(tmp_path / "c")
    assert loaded == saved
    assert type(loaded["config"]) is TrainConfig
    assert type(loaded["struct"]) is struct_pb2.Struct  # The generated class, with its mixins.
    assert loaded["struct"]["nested"]["deep"]["x"] == -1.5


def test_abstract_may_be_an_instance_or_the_type_name(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"d": duration_pb2.Duration(seconds=5)})
    by_instance = cp.load_checkpointables(tmp_path / "c", {"d": duration_pb2.Duration(seconds=1)})
    by_name = cp.load_checkpointables(tmp_path / "c", {"d": "google.protobuf.Duration"})
    assert by_instance["d"] == by_name["d"] == duration_pb2.Duration(seconds=5)


def test_metadata_can_be_passed_back_as_abstract(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"config": train_config()})
    meta = cp.checkpointables_metadata(tmp_path / "c")
    assert meta.metadata == {"config": TrainConfig}
    assert cp.load_checkpointables(tmp_path / "c", meta)["config"] == train_config()


def test_unimported_type_names_the_type_to_import(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"secret": Secret(code="42")})
    # The type is not in the default pool: metadata reports its name, not an error.
    meta = cp.checkpointables_metadata(tmp_path / "c")
    assert meta.metadata == {"secret": "checkpointables_test.private.Secret"}
    with pytest.raises(
        MessageTypeNotFoundError, match=r"checkpointables_test\.private\.Secret"
    ) as e:
        cp.load_checkpointables(tmp_path / "c")
    assert "Import the module that defines it" in str(e.value)
    assert isinstance(e.value, cp.errors.MissingHandlerError)
    # With the class, it loads.
    assert cp.load_checkpointables(tmp_path / "c", {"secret": Secret})["secret"] == Secret(
        code="42"
    )


def test_never_imports_a_module_named_in_the_checkpoint(tmp_path, monkeypatch) -> None:
    # A module that would leave a mark if anything imported it.
    package = tmp_path / "pkgs" / "evil_ckpt_mod"
    package.mkdir(parents=True)
    marker = tmp_path / "imported.txt"
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    cp.save_checkpointables(tmp_path / "c", {"config": duration_pb2.Duration(seconds=1)})
    file = tmp_path / "c" / "config" / "proto.pbtxt"
    file.write_text(file.read_text().replace("google.protobuf.Duration", "evil_ckpt_mod.Duration"))
    with_metadata_checksums_recomputed(tmp_path / "c")  # As a crafted checkpoint would.
    with pytest.raises(MessageTypeNotFoundError, match=r"evil_ckpt_mod\.Duration"):
        cp.load_checkpointables(tmp_path / "c")
    assert cp.checkpointables_metadata(tmp_path / "c").metadata == {
        "config": "evil_ckpt_mod.Duration"
    }
    assert "evil_ckpt_mod" not in sys.modules
    assert not marker.exists()


def test_wrong_class_is_refused(tmp_path) -> None:
    # Duration and Timestamp have the same fields: parsing would silently succeed.
    cp.save_checkpointables(tmp_path / "c", {"d": duration_pb2.Duration(seconds=5)})
    with pytest.raises(MessageTypeMismatchError, match=r"google\.protobuf\.Duration.*Timestamp"):
        cp.load_checkpointables(tmp_path / "c", {"d": timestamp_pb2.Timestamp})
    with pytest.raises(MessageTypeMismatchError, match="must be a message class"):
        cp.load_checkpointables(tmp_path / "c", {"d": {"seconds": 5}})


class Gate:
    """Saved by GateHandler, whose background phase blocks its thread until released."""

    def __init__(self) -> None:
        self.release = threading.Event()


class GateHandler:
    """Holds up the background phase of a save, so the test can act before it runs."""

    async def save(self, directory, checkpointable):
        async def write():
            # Blocks the background event loop: later writes wait for the release.
            assert checkpointable.release.wait(60)
            await directory.await_creation()

        return write()

    async def load(self, directory, abstract_checkpointable=None):
        raise AssertionError("never loaded")

    async def metadata(self, directory):
        return None

    def is_handleable(self, checkpointable):
        return isinstance(checkpointable, Gate)

    def is_abstract_handleable(self, abstract_checkpointable):
        return None


@pytest.fixture
def gate_handler():
    cp.handlers.register_handler(GateHandler, priority=1)
    yield
    cp.handlers.unregister_handler(GateHandler)


def test_async_save_snapshots_the_message(tmp_path, gate_handler) -> None:
    config, gate = train_config(), Gate()
    response = cp.save_checkpointables_async(tmp_path / "c", {"gate": gate, "config": config})
    config.learning_rate = 99.0  # The caller keeps working on its message at once,
    config.layers.append(7)
    gate.release.set()  # before the background phase writes anything.
    response.result()
    assert cp.load_checkpointables(tmp_path / "c", {"config": None})["config"] == train_config()


def test_floats_round_trip_exactly(tmp_path) -> None:
    values = [0.1, 1e-300, 2.0**-1074, 1.7976931348623157e308, -0.0, float("inf"), 1 / 3]
    message = struct_pb2.ListValue()
    message.extend(values)
    cp.save_checkpointables(tmp_path / "c", {"v": message})
    loaded = [v.number_value for v in cp.load_checkpointables(tmp_path / "c")["v"].values]
    assert [v.hex() for v in loaded] == [v.hex() for v in values]


def test_damaged_file_names_it_and_verify_reports_it(tmp_path, capsys) -> None:
    from checkpointables import cli

    cp.save_checkpointables(tmp_path / "c", {"config": train_config(), "s": Secret(code="1")})
    assert cli.main(["verify", str(tmp_path / "c")]) == 0
    assert "config: ok" in capsys.readouterr().out
    config_file = tmp_path / "c" / "config" / "proto.pbtxt"
    config_file.write_text(config_file.read_text()[:-8])  # Truncated: lost its closing brace.
    secret_file = tmp_path / "c" / "s" / "proto.pbtxt"
    secret_file.write_text(secret_file.read_text() + "extra {\n  x: 1\n")  # Cut mid-message.
    with pytest.raises(cp.errors.IntegrityError, match="proto.pbtxt"):
        cp.load_checkpointables(tmp_path / "c", {"config": TrainConfig})
    assert cli.main(["verify", str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert "config: FAILED" in out and "s: FAILED" in out
    # Without recorded checksums, Secret's type is unknown here, so the file can only be
    # skimmed: still caught.
    without_metadata_checksums(tmp_path / "c")
    assert cli.main(["verify", str(tmp_path / "c")]) == 1
    assert "unclosed" in capsys.readouterr().out


def test_missing_file_is_an_integrity_error(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"config": train_config()})
    (tmp_path / "c" / "config" / "proto.pbtxt").unlink()
    with pytest.raises(cp.errors.IntegrityError, match="holds no proto.pbtxt"):
        cp.load_checkpointables(tmp_path / "c")


def test_untyped_checkpoint_is_recognized_by_its_file(tmp_path) -> None:
    # An older checkpoint that records no handler for the item: the file decides.
    import json

    cp.save_checkpointables(tmp_path / "c", {"config": train_config()})
    meta_file = tmp_path / "c" / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_file.read_text())
    del meta["item_handlers"]["config"]
    meta_file.write_text(json.dumps(meta))
    without_metadata_checksums(tmp_path / "c")  # It predates them.
    assert cp.load_checkpointables(tmp_path / "c")["config"] == train_config()


def test_any_fields_need_their_type_imported(tmp_path) -> None:
    from google.protobuf import any_pb2

    packed = any_pb2.Any()
    packed.Pack(duration_pb2.Duration(seconds=3))
    cp.save_checkpointables(tmp_path / "c", {"any": packed})
    file = tmp_path / "c" / "any" / "proto.pbtxt"
    assert "[type.googleapis.com/google.protobuf.Duration] {" in file.read_text()  # Readable.
    assert cp.load_checkpointables(tmp_path / "c")["any"] == packed
    # As a program that never imported the packed type would see it.
    file.write_text(file.read_text().replace("google.protobuf.Duration", "elsewhere.Unknown"))
    with_metadata_checksums_recomputed(tmp_path / "c")
    with pytest.raises(
        MessageTypeNotFoundError, match=r"Any whose type is not imported.*elsewhere"
    ):
        cp.load_checkpointables(tmp_path / "c")


def test_non_utf8_file_is_an_integrity_error(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"config": train_config()})
    file = tmp_path / "c" / "config" / "proto.pbtxt"
    file.write_bytes(file.read_bytes() + b"name: '\xff\xfe'\n")
    with pytest.raises(cp.errors.IntegrityError, match="recorded checksum"):
        cp.load_checkpointables(tmp_path / "c")
    without_metadata_checksums(tmp_path / "c")
    with pytest.raises(cp.errors.IntegrityError, match="not UTF-8"):
        cp.load_checkpointables(tmp_path / "c")


def test_a_message_nested_deeper_than_python_parses_is_an_integrity_error(tmp_path) -> None:
    # 5,000 nested Structs in 330 KB of text: the parser recurses once per level.
    message = struct_pb2.Struct()
    message.update({"a": 1})
    cp.save_checkpointables(tmp_path / "c", {"config": message})
    deep = 'fields { key: "a" value { struct_value { ' * 5000 + "} } }" * 5000
    header = "# proto-file: google/protobuf/struct.proto\n# proto-message: google.protobuf.Struct\n"
    (tmp_path / "c" / "config" / "proto.pbtxt").write_text(header + deep)
    with_metadata_checksums_recomputed(tmp_path / "c")
    for abstract in (None, {"config": struct_pb2.Struct}):
        with pytest.raises(cp.errors.IntegrityError, match="proto.pbtxt nests its messages"):
            cp.load_checkpointables(tmp_path / "c", abstract)


MAX = cp.metadata_checksums.MAX_FILE_BYTES


def test_text_larger_than_a_metadata_file_is_refused() -> None:
    # What save checks the rendered text with; text_format escapes a 256 MiB string
    # byte by byte in Python (many seconds, GiBs), so the check is tested on the text.
    from checkpointables_proto._textproto import check_size

    # text_format escapes every non-ASCII byte, so the text is ASCII: one byte a character.
    with pytest.raises(cp.errors.InvalidArgumentError, match="'config' is 268,435,457 bytes"):
        check_size("x" * (MAX + 1), "config")


def test_a_huge_proto_file_is_refused_unread(tmp_path) -> None:
    from checkpointables import cli

    # Sparse: 3 GiB on no disk. Read whole, a 1 GiB one took 34 s.
    cp.save_checkpointables(tmp_path / "c", {"config": train_config()})
    with open(tmp_path / "c" / "config" / "proto.pbtxt", "r+b") as f:
        f.truncate(3 << 30)
    with_metadata_checksums_recomputed(tmp_path / "c")  # It is now data, as core sees it.
    with TracedPeak() as traced:
        for abstract in (None, {"config": TrainConfig}):
            with pytest.raises(cp.errors.MetadataError, match="proto.pbtxt holds more than"):
                cp.load_checkpointables(tmp_path / "c", abstract)
        with pytest.raises(cp.errors.MetadataError, match="proto.pbtxt holds more than"):
            cp.checkpointables_metadata(tmp_path / "c")
        assert cli.main(["verify", str(tmp_path / "c")]) == 1
    assert traced.peak < 64 << 20, traced.peak


def test_a_parse_error_quotes_a_few_hundred_characters(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"d": duration_pb2.Duration(seconds=1)})
    with open(tmp_path / "c" / "d" / "proto.pbtxt", "a") as f:
        f.write("seconds: " + "9" * (1 << 20) + "\n")  # The parser quotes the line whole.
    with_metadata_checksums_recomputed(tmp_path / "c")
    with pytest.raises(cp.errors.IntegrityError, match="cut from") as caught:
        cp.load_checkpointables(tmp_path / "c")
    assert "proto.pbtxt is not a valid" in str(caught.value) and len(str(caught.value)) < 1000


def test_a_message_protobuf_cannot_write_is_refused_before_writing(tmp_path) -> None:
    message = struct_pb2.Struct()
    inner = message
    for _ in range(60):  # 120 levels: protobuf refuses past 100.
        inner = inner.fields["a"].struct_value
    with pytest.raises(cp.errors.InvalidArgumentError, match="'config'.*nested more deeply"):
        cp.save_checkpointables(tmp_path / "c", {"config": message})
    assert not (tmp_path / "c").exists()


def test_a_class_that_is_no_message_is_named(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"d": duration_pb2.Duration(seconds=5)})
    with pytest.raises(MessageTypeMismatchError, match="got the class int"):
        cp.load_checkpointables(tmp_path / "c", {"d": int})


def test_saving_a_message_class_asks_for_an_instance(tmp_path) -> None:
    hint = r"proto: Duration is a message class; save a message, an instance such as Duration"
    with pytest.raises(cp.errors.NoHandlerForObjectError, match=hint):
        cp.save_checkpointables(tmp_path / "c", {"timeout": duration_pb2.Duration})


def test_a_message_given_to_save_pytree_names_the_handler_that_saves_it(tmp_path) -> None:
    hint = r"The proto handler saves it: save it with cp.save_checkpointables\({'pytree': obj}\)"
    with pytest.raises(cp.errors.NoHandlerForObjectError, match=hint):
        cp.save_pytree(tmp_path / "c", duration_pb2.Duration(seconds=1))
    assert not (tmp_path / "c").exists()


def _with_recorded_type(checkpoint, recorded: str, *, keep_checksums: bool = True) -> None:
    """Rewrites the '# proto-message:' header of checkpointable 'd', as a forger would."""
    file = checkpoint / "d" / "proto.pbtxt"
    header = "# proto-message: google.protobuf.Duration"
    file.write_text(file.read_text().replace(header, f"# proto-message: {recorded}"))
    if keep_checksums:
        with_metadata_checksums_recomputed(checkpoint)
    else:
        without_metadata_checksums(checkpoint)


@pytest.mark.parametrize(
    "recorded",
    [
        "x" * 10_000_000,  # Quoted three times, a 30 MB MessageTypeNotFoundError.
        "a" * 4097,
        "google..Duration",
        ".google.protobuf.Duration",
        "google.protobuf.Duration.",
        "1google.Duration",
        "google.protobuf.Duration extra",
        "google-protobuf.Duration",
        "google.protobuf.Dur\u00e9e",
        "",
    ],
    ids=lambda r: repr(r[:30]),
)
@pytest.mark.parametrize("keep_checksums", [True, False])
def test_a_recorded_type_that_is_no_full_name_is_an_integrity_error(
    tmp_path, capsys, recorded, keep_checksums
) -> None:
    from checkpointables import cli

    cp.save_checkpointables(tmp_path / "c", {"d": duration_pb2.Duration(seconds=1)})
    _with_recorded_type(tmp_path / "c", recorded, keep_checksums=keep_checksums)
    for call in (
        lambda: cp.load_checkpointables(tmp_path / "c"),
        lambda: cp.load_checkpointables(tmp_path / "c", {"d": timestamp_pb2.Timestamp}),
        lambda: cp.checkpointables_metadata(tmp_path / "c"),
    ):
        with pytest.raises(cp.errors.IntegrityError, match="proto-message.*no protobuf full") as e:
            call()
        assert str(tmp_path / "c" / "d" / "proto.pbtxt") in str(e.value)
        assert "damaged" in str(e.value) and len(str(e.value)) < 1000
    assert cli.main(["verify", str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert "no protobuf full name" in out and len(out) < 2000


def test_the_longest_full_name_is_read_and_quoted_briefly(tmp_path) -> None:
    # As long as a recorded name may be: metadata reports it; errors quote 200 characters.
    longest = ".".join(["a" * 99] * 41)[:4096].rstrip(".")
    cp.save_checkpointables(tmp_path / "c", {"d": duration_pb2.Duration(seconds=1)})
    _with_recorded_type(tmp_path / "c", longest)
    assert cp.checkpointables_metadata(tmp_path / "c").metadata == {"d": longest}
    with pytest.raises(MessageTypeNotFoundError, match="cut from") as e:
        cp.load_checkpointables(tmp_path / "c")
    assert len(str(e.value)) < 1500
    with pytest.raises(MessageTypeMismatchError, match="cut from") as mismatch:
        cp.load_checkpointables(tmp_path / "c", {"d": timestamp_pb2.Timestamp})
    assert len(str(mismatch.value)) < 1500


def test_a_huge_type_name_given_to_load_is_quoted_briefly(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"d": duration_pb2.Duration(seconds=1)})
    with pytest.raises(MessageTypeMismatchError, match="cut from") as e:
        cp.load_checkpointables(tmp_path / "c", {"d": "x" * 10_000_000})
    assert len(str(e.value)) < 1000
    file = tmp_path / "c" / "d" / "proto.pbtxt"
    file.write_text(file.read_text().replace("# proto-message: google.protobuf.Duration\n", ""))
    with_metadata_checksums_recomputed(tmp_path / "c")  # As Orbax writes it: no header.
    with pytest.raises(MessageTypeNotFoundError, match="cut from") as e:
        cp.load_checkpointables(tmp_path / "c", {"d": "x" * 10_000_000})
    assert len(str(e.value)) < 1000
