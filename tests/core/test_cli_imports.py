"""What the command line imports: ``--help`` and argument errors only the plugins' commands,
not what their handlers need (JAX: a second or two of every call), and ``import
checkpointables`` none of the library's modules until one is used.

Each test runs a new interpreter (``sys.modules`` is per process), with a throwaway
plugin distribution on ``PYTHONPATH``, found through its entry point as an installed one.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from ..python_subprocess import install_fake_distribution, run_python

# Their packages import JAX at their top (their __init__ imports their handlers), so loading
# their entry points does, whichever hooks are called; until those import lazily they are
# left out here, and the plugin below stands in: its handler hook imports JAX.
_IMPORT_JAX_WITH_THEIR_PACKAGE = ""

_PLUGIN = """
    import checkpointables as cp

    def hello(args):
        print("hello", args.who)
        return 0

    @cp.hookimpl
    def register_commands(register):
        register("hello", hello, help="say hello",
                 add_arguments=lambda parser: parser.add_argument("who"))

    @cp.hookimpl
    def register_checkpointable_handlers(register):
        {handlers}
"""

_RUN_CLI = """
import sys
from checkpointables import cli

try:
    status = cli.main(sys.argv[1:])
except SystemExit as e:
    status = e.code
heavy = sorted(m for m in ("jax", "tensorstore", "checkpointables._loading") if m in sys.modules)
print("imported:", heavy)
sys.exit(status)
"""


def _cli(
    tmp_path, *args: str, handlers: str = "import jax  # What a handler needs; listing does not."
) -> subprocess.CompletedProcess[str]:
    root = Path(tempfile.mkdtemp(dir=tmp_path))  # One distribution per call.
    env = install_fake_distribution(root, "fast-plugin", _PLUGIN.format(handlers=handlers))
    env["CHECKPOINTABLES_DISABLE_PLUGINS"] = _IMPORT_JAX_WITH_THEIR_PACKAGE
    return subprocess.run(
        [sys.executable, "-c", _RUN_CLI, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_help_and_argument_errors_import_no_jax(tmp_path) -> None:
    shown = _cli(tmp_path, "--help")
    assert shown.returncode == 0, shown.stderr
    assert "say hello" in shown.stdout  # The plugin's command is listed...
    assert "imported: []" in shown.stdout  # ... without calling its handler hook.
    wrong = _cli(tmp_path, "inspect")  # No path given.
    assert wrong.returncode == 2
    assert "the following arguments are required: path" in wrong.stderr
    assert "imported: []" in wrong.stdout


def test_a_plugin_command_runs_only_where_its_plugin_loads(tmp_path) -> None:
    ran = _cli(tmp_path, "hello", "world", handlers="pass")
    assert ran.returncode == 0, ran.stderr
    assert "hello world" in ran.stdout
    # Its handler hook fails: the plugin is skipped, with the warning saying why, and its
    # command with it, though listing commands alone found it.
    broken = _cli(tmp_path, "hello", "world", handlers="raise RuntimeError('no handlers today')")
    assert broken.returncode == 2
    assert "no handlers today" in broken.stderr and "invalid choice: 'hello'" in broken.stderr
    assert "hello world" not in broken.stdout


def test_import_checkpointables_imports_a_name_where_it_is_used(tmp_path) -> None:
    code = """
        import sys
        import checkpointables as cp

        assert not {"numpy", "jax", "checkpointables.context"} & set(sys.modules)
        assert set(cp.__all__) <= set(dir(cp))
        for name in cp.__all__:
            getattr(cp, name)
        assert cp.save is cp.save_pytree and cp.metadata is cp.pytree_metadata
        assert cp.Context is sys.modules["checkpointables.context"].Context
        from checkpointables import errors, is_checkpoint, _loading
        assert is_checkpoint is cp.layout.is_checkpoint and errors is cp.errors
        try:
            cp.sav_pytree
        except AttributeError as e:
            assert "has no attribute 'sav_pytree'" in str(e)
        else:
            raise AssertionError("cp.sav_pytree resolved")
        # Any submodule, as when the packages imported them all (the docs name a few).
        import checkpointables_pytree as pytree
        assert cp.checkpoint_metadata.CHECKPOINT_METADATA_FILE == "_CHECKPOINT_METADATA"
        assert pytree.ocdbt.MAX_MANIFEST_BYTES and pytree.tree.MAX_DEPTH
    """
    done = run_python(code)
    assert done.returncode == 0, done.stderr
