"""The command line: commands added by plugins, ``--quiet`` and progress bars on terminals."""

from __future__ import annotations

import os
import re
import shutil
import textwrap

import checkpointables as cp
import importlib_metadata
import jax.numpy as jnp
import numpy as np
import pytest
from checkpointables import cli, plugins

from ..python_subprocess import run_on_terminal

_COMMANDS_PLUGIN = """
    import checkpointables as cp

    def hello(args):
        print(f"hello {args.who}, quiet={args.quiet}")
        return 3

    def add_hello_arguments(parser):
        parser.add_argument("who")

    def add_broken_arguments(parser):
        raise RuntimeError("no arguments today")

    @cp.hookimpl
    def register_commands(register):
        register("hello", hello, help="say hello", add_arguments=add_hello_arguments)
        register("verify", hello, help="clashes with the built-in")
        register("broken", hello, help="fails to add its arguments",
                 add_arguments=add_broken_arguments)
"""


@pytest.fixture
def commands_plugin(tmp_path, monkeypatch):
    """A real plugin module registering commands, discovered through its entry point."""
    (tmp_path / "cpt_commands_plugin.py").write_text(textwrap.dedent(_COMMANDS_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = importlib_metadata.EntryPoint(
        name="commands", value="cpt_commands_plugin", group=plugins.ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(plugins, "_cached", plugins.discover([ep], disabled=set()))


def test_plugin_commands_run_and_clashes_are_skipped(commands_plugin, capsys) -> None:
    with pytest.warns(RuntimeWarning) as warned:
        status = cli.main(["hello", "world", "--quiet"])
    assert status == 3
    assert capsys.readouterr().out == "hello world, quiet=True\n"
    messages = [str(w.message) for w in warned]
    assert any(
        "'verify', which is skipped: the name 'verify' is already taken" in m for m in messages
    )
    assert any(
        "'broken', which is skipped: adding its arguments failed: Runtime" in m for m in messages
    )
    with pytest.warns(RuntimeWarning):
        help_text = cli.build_parser().format_help()
    assert "say hello" in help_text and "broken" not in help_text


def test_plugins_lists_skipped_commands_as_skipped(commands_plugin, tmp_path, monkeypatch, capsys):
    # A second plugin taking 'hello' too: plugins come in order, so the first one's runs.
    (tmp_path / "cpt_second_plugin.py").write_text(
        "import checkpointables as cp\n"
        "@cp.hookimpl\n"
        "def register_commands(register):\n"
        "    register('hello', print, help='hello again')\n"
    )
    eps = [
        importlib_metadata.EntryPoint(name=n, value=v, group=plugins.ENTRY_POINT_GROUP)
        for n, v in [("commands", "cpt_commands_plugin"), ("second", "cpt_second_plugin")]
    ]
    monkeypatch.setattr(plugins, "_cached", plugins.discover(eps, disabled=set()))
    with pytest.warns(RuntimeWarning):
        assert cli.main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "    command hello: say hello" in lines  # Added: no status.
    assert (
        "    command verify: clashes with the built-in  "
        "[skipped: the name 'verify' is already taken by a built-in command]"
    ) in lines
    assert (
        "    command broken: fails to add its arguments  "
        "[skipped: adding its arguments failed: RuntimeError: no arguments today]"
    ) in lines
    assert (
        "    command hello: hello again  "
        "[skipped: the name 'hello' is already taken by the command of plugin 'commands']"
    ) in lines
    # What the listing says is what the parser does.
    with pytest.warns(RuntimeWarning):
        parser = cli.build_parser()
    assert parser.parse_args(["hello", "x"]).run.__module__ == "cpt_commands_plugin"
    with pytest.raises(SystemExit):
        parser.parse_args(["broken"])


def test_bad_registrations_fail_the_plugin_with_a_warning(tmp_path, monkeypatch) -> None:
    (tmp_path / "cpt_bad_command.py").write_text(
        "import checkpointables as cp\n"
        "@cp.hookimpl\n"
        "def register_commands(register):\n"
        "    register('two words', print)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = importlib_metadata.EntryPoint(
        name="bad", value="cpt_bad_command", group=plugins.ENTRY_POINT_GROUP
    )
    with pytest.warns(RuntimeWarning, match="non-empty word"):
        found = plugins.discover([ep], disabled=set())
    assert found.plugins[0].status == "failed"
    assert found.commands == ()


def test_no_progress_when_stderr_is_not_a_terminal(tmp_path, capfd) -> None:
    cp.save_pytree(tmp_path / "c", {"w": np.arange(1000.0)})
    assert cli.main(["verify", str(tmp_path / "c")]) == 0
    captured = capfd.readouterr()
    assert captured.err == ""
    assert "all checks passed" in captured.out


def test_verify_shows_bytes_total_and_rate_on_a_terminal(tmp_path) -> None:
    cp.save_pytree(tmp_path / "c", {"w": np.ones((256, 1024), np.float32), "b": np.ones(10)})
    shown = run_on_terminal("verify", str(tmp_path / "c"))
    assert "verify pytree" in shown
    assert "1.00M/1.00M" in shown  # 256 KiB x 4 + 80 B, in binary units.
    assert "B/s" in shown
    assert run_on_terminal("verify", "--quiet", str(tmp_path / "c")) == ""


def test_quiet_goes_before_or_after_the_command() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["-q", "plugins"]).quiet
    assert parser.parse_args(["plugins", "--quiet"]).quiet
    assert not parser.parse_args(["plugins"]).quiet


def test_inspect_shows_the_size_of_bytes_leaves(tmp_path, capsys) -> None:
    tree = {"blob": b"abcd", "none": b"", "w": np.ones(3, np.float32), "step": 3, "name": "x"}
    cp.save_pytree(tmp_path / "c", tree)
    assert cli.main(["inspect", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "['blob']: BytesMetadata  (4 B)" in out and "['none']: BytesMetadata  (0 B)" in out
    assert "['w']: NumpyMetadata shape=(3,) dtype=float32  (12 B)" in out
    # Scalars and strings: their metadata records no size, and none is made up.
    assert "['step']: int\n" in out and "['name']: str\n" in out
    assert "total array bytes: 16" in out
    metadata = cp.pytree_metadata(tmp_path / "c").metadata
    assert metadata["blob"] == b"" and metadata["blob"].nbytes == 4  # Still an abstract bytes.
    assert cp.load_pytree(tmp_path / "c", metadata)["blob"] == b"abcd"


class _TextHandler:
    """A handler registered for one test, then removed: its checkpoints outlive it."""

    async def save(self, directory, checkpointable):
        async def write() -> None:
            path = await directory.await_creation()
            cp.storage.write_text(path / "text", checkpointable.value)

        return write()

    async def load(self, directory, abstract_checkpointable=None): ...

    async def metadata(self, directory) -> None:
        return None

    def is_handleable(self, obj) -> bool:
        return type(obj).__name__ == "_Text"

    def is_abstract_handleable(self, abstract) -> None:
        return None


class _Text:
    def __init__(self, value: str) -> None:
        self.value = value


def test_inspect_names_the_plugin_that_reads_each_recorded_handler(tmp_path, capsys) -> None:
    # The pytree handler records Orbax's class name (Orbax reads it too): which of our
    # plugins reads it is said beside it, and so is a handler no installed plugin reads.
    cp.handlers.register_handler(_TextHandler)
    try:
        cp.save_checkpointables(tmp_path / "c", {"state": {"w": np.ones(2)}, "note": _Text("x")})
    finally:
        cp.handlers.unregister_handler(_TextHandler)
    assert cli.main(["inspect", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "state/  handler: orbax.checkpoint.experimental.v1." in out
    assert "PyTreeHandler  (read by plugin 'pytree')" in out
    assert "_TextHandler  (no installed plugin reads it)" in out


def test_paths_that_are_no_directory_are_an_error_line(tmp_path, capsys) -> None:
    pipe, file = tmp_path / "pipe", tmp_path / "file"
    os.mkfifo(pipe)
    file.write_text("x")
    assert cli.main(["inspect", str(pipe)]) == 2
    assert f"error: {pipe} is a file, not a checkpoint directory." in capsys.readouterr().err
    # A training root that is a file: NotADirectoryError, once a raw traceback.
    assert cli.main(["demo", "--steps", "4", str(file)]) == 2
    assert "a Checkpointer needs a directory" in capsys.readouterr().err


def test_names_holding_control_characters_are_escaped(tmp_path, capsys) -> None:
    # A stray directory forging a line and clearing the screen.
    cp.save_pytree(tmp_path / "c", {"a": np.arange(3)})
    (tmp_path / "c" / "junk\nall checks passed\x1b[2J").mkdir()
    assert cli.main(["verify", str(tmp_path / "c")]) == 1
    assert cli.main(["inspect", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "junk\\nall checks passed\\x1b[2J" in out
    assert not any(line.startswith("all checks passed") for line in out.splitlines())


def test_inspect_sorts_names_naturally_and_says_when_a_source_is_gone(tmp_path, capsys) -> None:
    # 64 KiB each: tracked by incremental saves. JAX and sorted() put layer_10 first.
    state = {f"layer_{i}": jnp.full((128, 128), i, jnp.float32) for i in (10, 2, 1)}
    state["steps"] = list(range(11))  # A list keeps its order: [2] before [10].
    cp.save_pytree(tmp_path / "8", state)
    cp.save_pytree(tmp_path / "9", state, reuse_from=tmp_path / "8")
    assert cli.main(["inspect", str(tmp_path / "9")]) == 0
    out = capsys.readouterr().out
    shown = re.findall(r"\['layer_(\d+)'\]|\['steps'\]\[(\d+)\]", out)
    assert [a or b for a, b in shown] == ["1", "2", "10", *map(str, range(11))]
    reuse = re.findall(r"    layer_(\d+): (.*)", out)
    assert reuse == [(n, "reused from 8") for n in ("1", "2", "10")]
    shutil.rmtree(tmp_path / "8")  # The reused files are links: step 9 stays whole.
    assert cli.main(["inspect", str(tmp_path / "9")]) == 0
    out = capsys.readouterr().out
    assert "layer_2: reused from 8 (since deleted; this checkpoint holds its own copy)" in out
    assert cli.main(["verify", str(tmp_path / "9")]) == 0


def test_inspect_says_a_step_saved_over_reused_from_the_save_it_replaced(tmp_path, capsys):
    # Re-saving the newest step (overwrite=True) reuses from the step it replaces, whose
    # directory is then removed: "reused from 1" in step 1 names a save that is gone.
    state = {"base": jnp.ones((128, 128), jnp.float32), "adapter": jnp.zeros((128, 128))}
    with cp.training.Checkpointer(tmp_path / "run", reuse_unchanged=True) as ckptr:
        ckptr.save_pytree(0, state)
        ckptr.save_pytree(1, state)
        state["adapter"] = state["adapter"] + 1
        ckptr.save_pytree(1, state, force=True, overwrite=True)
    assert cli.main(["inspect", str(tmp_path / "run" / "1")]) == 0
    reuse = dict(re.findall(r"    (\w+): (.*)", capsys.readouterr().out))
    assert reuse == {
        "adapter": "written",
        "base": "reused from 1 (the save this one replaced; this checkpoint holds its own copy)",
    }


def test_inspect_keeps_number_keys_in_their_order(tmp_path, capsys) -> None:
    cp.save_pytree(tmp_path / "c", {k: np.zeros(2, np.float32) for k in (-1, -10, 2, 0)})
    assert cli.main(["inspect", str(tmp_path / "c")]) == 0
    assert re.findall(r"\[(-?\d+)\]", capsys.readouterr().out) == ["-10", "-1", "0", "2"]


def test_a_dashed_word_after_a_flag_is_not_made_its_value(capsys) -> None:
    # --quiet takes no value: -5x is an unknown argument, not "--quiet=-5x".
    with pytest.raises(SystemExit) as exited:
        cli.main(["plugins", "--quiet", "-5x"])
    assert exited.value.code == 2
    assert "unrecognized arguments: -5x" in capsys.readouterr().err


def test_a_dashed_value_after_an_abbreviated_option_reaches_the_option(capsys) -> None:
    # argparse accepts --step for --steps: -3x is its value there too, not an option.
    with pytest.raises(SystemExit) as exited:
        cli.main(["demo", "--step", "-3x"])
    assert exited.value.code == 2
    assert "argument --steps: invalid int value: '-3x'" in capsys.readouterr().err


def test_demo_errors_go_to_stderr(tmp_path, capsys) -> None:
    # A negative number stays a value for argparse (not joined to its option).
    assert cli.main(["demo", "--steps", "-3", str(tmp_path / "d")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "error: --steps must be at least 4" in captured.err


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_path_the_system_cannot_resolve_is_one_line_not_a_traceback(
    tmp_path, capsys, command
) -> None:
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    if command == "verify":  # A load would fail: a failed check, as for a missing path.
        assert cli.main([command, str(tmp_path / "loop1")]) == 1
        (line,) = [x for x in capsys.readouterr().out.splitlines() if "FAILED" in x]
        assert f"{tmp_path / 'loop1'} is a symbolic link that leads back to itself" in line
        return
    assert cli.main([command, str(tmp_path / "loop1")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "symbolic link" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("command", "description"),
    [
        ("plugins", "list installed plugins"),
        ("inspect", "print what a checkpoint"),
        ("verify", "check every metadata file"),
        ("demo", "train a small JAX model"),
    ],
)
def test_each_built_in_command_help_opens_with_its_description(
    command, description, capsys
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main([command, "--help"])
    assert exited.value.code == 0
    usage, _, rest = capsys.readouterr().out.partition("\n\n")
    assert usage.startswith("usage:") and rest.startswith(description), rest


@pytest.mark.parametrize("theirs_first", [True, False])
def test_a_third_party_command_never_takes_the_name_of_ours(
    tmp_path, monkeypatch, theirs_first
) -> None:
    # The safetensors plugin's `export`, before and after the third party's entry point.
    (tmp_path / "cpt_export_plugin.py").write_text(
        "import checkpointables as cp\n"
        "@cp.hookimpl\n"
        "def register_commands(register):\n"
        "    register('export', print, help='their export')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    theirs = importlib_metadata.EntryPoint(
        name="their_export", value="cpt_export_plugin", group=plugins.ENTRY_POINT_GROUP
    )
    installed = importlib_metadata.entry_points(group=plugins.ENTRY_POINT_GROUP)
    ours = [ep for ep in installed if ep.name == "safetensors"]
    eps = [theirs, *ours] if theirs_first else [*ours, theirs]
    monkeypatch.setattr(plugins, "_cached", plugins.discover(eps, disabled=set()))
    with pytest.warns(RuntimeWarning, match="'export' is already taken by the command of plugin"):
        parser = cli.build_parser()
    assert parser.parse_args(["export", "a", "b"]).run.__module__.startswith(
        "checkpointables_safetensors"
    )
