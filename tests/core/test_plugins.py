"""Plugin discovery through pluggy, with entry points built directly (no install needed)."""

from __future__ import annotations

import textwrap

import checkpointables as cp
import importlib_metadata
import pytest
from checkpointables import plugins


def _ep(name: str, module: str) -> importlib_metadata.EntryPoint:
    return importlib_metadata.EntryPoint(name=name, value=module, group=plugins.ENTRY_POINT_GROUP)


@pytest.fixture
def plugin_modules(tmp_path, monkeypatch):
    """Writes plugin modules into a directory on sys.path; returns a writer."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(module: str, source: str) -> str:
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        return module

    return write


_GOOD = """
    import checkpointables as cp

    class {cls}:
        async def save(self, directory, checkpointable): ...
        async def load(self, directory, abstract_checkpointable=None): ...
        async def metadata(self, directory): ...
        def is_handleable(self, obj): return False
        def is_abstract_handleable(self, abstract): return None

    @cp.hookimpl
    def register_checkpointable_handlers(register):
        register({cls}, priority={priority})
"""


def test_discovery_collects_handlers_in_resolution_order(plugin_modules) -> None:
    a = plugin_modules("cpt_plugin_a", _GOOD.format(cls="ZetaHandler", priority=10))
    b = plugin_modules("cpt_plugin_b", _GOOD.format(cls="AlphaHandler", priority=10))
    c = plugin_modules("cpt_plugin_c", _GOOD.format(cls="LateHandler", priority=5))
    found = plugins.discover([_ep("b", b), _ep("a", a), _ep("c", c)], disabled=set())
    assert [p.name for p in found.plugins] == ["b", "a", "c"]
    assert all(p.status == "loaded" for p in found.plugins)
    assert [h.name for h in found.handlers] == ["late", "alpha", "zeta"]
    # The order is a function of the registrations, not of entry-point order.
    again = plugins.discover([_ep("c", c), _ep("a", a), _ep("b", b)], disabled=set())
    assert [h.name for h in again.handlers] == ["late", "alpha", "zeta"]


def test_broken_plugins_are_skipped_with_a_warning(plugin_modules) -> None:
    good = plugin_modules("cpt_plugin_good", _GOOD.format(cls="GoodHandler", priority=10))
    raising = plugin_modules(
        "cpt_plugin_raising",
        """
        import checkpointables as cp

        @cp.hookimpl
        def register_checkpointable_handlers(register):
            raise RuntimeError("cannot register today")
        """,
    )
    not_a_handler = plugin_modules(
        "cpt_plugin_bad_register",
        """
        import checkpointables as cp

        @cp.hookimpl
        def register_checkpointable_handlers(register):
            register(int)
        """,
    )
    eps = [
        _ep("good", good),
        _ep("missing", "cpt_no_such_module_anywhere"),
        _ep("raising", raising),
        _ep("bad-register", not_a_handler),
    ]
    with pytest.warns(RuntimeWarning) as record:
        found = plugins.discover(eps, disabled=set())
    messages = [str(w.message) for w in record]
    assert len(messages) == 3
    assert any("'missing'" in m and "No module named" in m for m in messages)
    assert any("'raising'" in m and "cannot register today" in m for m in messages)
    assert any("'bad-register'" in m and "not a CheckpointableHandler" in m for m in messages)
    status = {p.name: (p.status, p.error) for p in found.plugins}
    assert status["good"] == ("loaded", None)
    assert (
        status["missing"][0] == "failed" and "cpt_no_such_module_anywhere" in status["missing"][1]
    )
    assert [h.name for h in found.handlers] == ["good"]


def test_disabled_plugins_are_not_imported(plugin_modules) -> None:
    module = plugin_modules(
        "cpt_plugin_explodes_on_import", "raise SystemError('must not be imported')"
    )
    found = plugins.discover([_ep("boom", module)], disabled={"boom"})
    (info,) = found.plugins
    assert info.status == "disabled" and plugins.DISABLE_ENV_VAR in info.error


def test_duplicate_handler_names_fail_both_plugins_in_either_order(plugin_modules) -> None:
    # tests/core/test_plugin_name_clashes.py has the rule, with installed distributions.
    first = plugin_modules("cpt_plugin_first", _GOOD.format(cls="SameHandler", priority=10))
    second = plugin_modules("cpt_plugin_second", _GOOD.format(cls="SameHandler", priority=20))
    in_order = [_ep("first", first), _ep("second", second)]
    for eps in (in_order, in_order[::-1]):
        with pytest.warns(RuntimeWarning, match="registers too"):
            found = plugins.discover(eps, disabled=set())
        assert {p.name: p.status for p in found.plugins} == {"first": "failed", "second": "failed"}
        assert found.handlers == ()


def test_a_failing_plugin_is_warned_of_at_its_own_line_in_one_sentence(plugin_modules) -> None:
    module = plugin_modules(
        "cpt_plugin_bad_priority",
        """
        import checkpointables as cp

        @cp.hookimpl
        def register_checkpointable_handlers(register):
            register(cp.builtin_plugin.StatefulCheckpointableHandler, priority="high")
        """,
    )
    with pytest.warns(RuntimeWarning) as record:
        plugins.discover([_ep("bad-priority", module)], disabled=set())
    (warning,) = record
    assert "priority must be an int, got 'high'. Reinstall or fix it" in str(warning.message)
    # It points at the plugin's register(...) call, not at the library's discovery.
    assert warning.filename.endswith("cpt_plugin_bad_priority.py") and warning.lineno == 6


def test_a_plugin_that_is_not_there_is_warned_of_at_its_entry_point() -> None:
    with pytest.warns(RuntimeWarning) as record:
        plugins.discover([_ep("gone", "cpt_no_such_module_here")], disabled=set())
    (warning,) = record
    assert warning.filename == "<checkpointables entry point gone = cpt_no_such_module_here>"


def test_installed_plugins_are_listed_with_distribution_and_version() -> None:
    infos = {p.name: p for p in cp.plugins.list_plugins()}
    assert infos["json"].distribution == "checkpointables-json"
    assert infos["json"].version
    assert [h.name for h in infos["json"].handlers] == ["json"]
    assert infos["stateful"].distribution == "checkpointables-core"
    assert infos["example-point"].status == "loaded"


def test_discovery_is_lazy_and_refreshable() -> None:
    import subprocess
    import sys

    code = (
        "import checkpointables, checkpointables.plugins as p, sys;"
        "assert p._cached is None;"
        "checkpointables.handlers.registered_handlers();"
        "assert p._cached is not None;"
        "p.refresh(); assert p._cached is None"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_register_handler_and_get(tmp_path) -> None:
    class PairHandler:
        async def save(self, directory, checkpointable): ...
        async def load(self, directory, abstract_checkpointable=None): ...
        async def metadata(self, directory): ...
        def is_handleable(self, obj):
            return isinstance(obj, tuple) and len(obj) == 2

        def is_abstract_handleable(self, abstract):
            return None

    assert cp.handlers.register_handler(PairHandler) is PairHandler
    try:
        assert cp.handlers.get("pair") is PairHandler
        assert cp.handlers.get(cp.handlers.typestr(PairHandler)) is PairHandler
        assert PairHandler in [r.handler_cls for r in cp.handlers.registered_handlers()]
    finally:
        cp.handlers.unregister_handler(PairHandler)
    with pytest.raises(cp.errors.MissingHandlerError, match="No handler named 'pair'"):
        cp.handlers.get("pair")
    with pytest.raises(cp.errors.MissingHandlerError, match="pip install checkpointables-proto"):
        cp.handlers.get("checkpointables_proto.SomethingHandler")


def test_registering_again_with_another_priority_warns() -> None:
    class TwiceHandler:
        async def save(self, directory, checkpointable): ...
        async def load(self, directory, abstract_checkpointable=None): ...
        async def metadata(self, directory): ...
        def is_handleable(self, obj):
            return False

        def is_abstract_handleable(self, abstract):
            return None

    cp.handlers.register_handler(TwiceHandler, priority=30)
    try:
        cp.handlers.register_handler(TwiceHandler, priority=30)  # The same: silent.
        with pytest.warns(UserWarning, match="already called with priority 30.*priority 5"):
            cp.handlers.register_handler(TwiceHandler, priority=5)
        priorities = [
            r.priority for r in cp.handlers.registered_handlers() if r.handler_cls is TwiceHandler
        ]
        assert priorities == [5]
        cp.handlers.unregister_handler(TwiceHandler)
        cp.handlers.register_handler(TwiceHandler, priority=40)  # Changed on purpose: silent.
    finally:
        cp.handlers.unregister_handler(TwiceHandler)
