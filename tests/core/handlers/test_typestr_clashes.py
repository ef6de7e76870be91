"""A typestr two handlers claim is read (and written) by neither until the user chooses:
data one plugin wrote must never be read by another silently."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator

import checkpointables as cp
import importlib_metadata
import pytest
from checkpointables import plugins

JSON_TYPESTR = "orbax.checkpoint.experimental.v1._src.handlers.json_handler.JsonHandler"


class _ClaimingHandler:
    """Reads anything, and claims what a test says (by ``register_handler``)."""

    async def save(self, directory, checkpointable) -> None: ...

    async def load(self, directory, abstract_checkpointable=None) -> str:
        return "hijacked"

    async def metadata(self, directory) -> None:
        return None

    def is_handleable(self, checkpointable) -> bool:
        return isinstance(checkpointable, dict)

    def is_abstract_handleable(self, abstract_checkpointable) -> None:
        return None


@pytest.fixture
def recording_json() -> Iterator[None]:
    """``_ClaimingHandler`` registered in this process, ahead of the JSON plugin's handler,
    recording the JSON plugin's typestr."""
    cp.handlers.register_handler(_ClaimingHandler, priority=5, typestr=JSON_TYPESTR)
    yield
    cp.handlers.unregister_handler(_ClaimingHandler)


def test_a_bare_str_of_secondary_typestrs_is_refused() -> None:
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match=r"pass \['abc'\]"):
        cp.handlers.register_handler(_ClaimingHandler, secondary_typestrs="abc")
    assert _ClaimingHandler not in {r.handler_cls for r in cp.handlers.registered_handlers()}
    with pytest.raises(cp.errors.InvalidArgumentTypeError, match="non-empty strs"):
        cp.handlers.register_handler(_ClaimingHandler, secondary_typestrs=["a", ""])


def test_loading_a_typestr_two_handlers_claim_refuses(tmp_path) -> None:
    cp.save_checkpointables(tmp_path / "c", {"e": {"a": 1}})
    cp.handlers.register_handler(_ClaimingHandler, secondary_typestrs=[JSON_TYPESTR], priority=5)
    try:
        with pytest.raises(cp.errors.PluginError) as raised:
            cp.load_checkpointables(tmp_path / "c")
        message = str(raised.value)
        assert "plugin 'json'" in message and "_ClaimingHandler" in message
        assert "create_with_handlers(e=" in message and "unregister_handler" in message
        with pytest.raises(cp.errors.PluginError, match="'json'"):
            cp.handlers.get(JSON_TYPESTR)
        assert cp.handlers.get("json").__name__ == "JsonHandler"
        # The user says which: the handler forced for the name reads it.
        options = cp.options.CheckpointablesOptions.create_with_handlers(e="json")
        with cp.Context(checkpointables_options=options):
            assert cp.load_checkpointables(tmp_path / "c") == {"e": {"a": 1}}
    finally:
        cp.handlers.unregister_handler(_ClaimingHandler)
    assert cp.load_checkpointables(tmp_path / "c") == {"e": {"a": 1}}


def test_saving_with_a_handler_whose_typestr_is_claimed_twice_refuses(
    tmp_path, recording_json
) -> None:
    """Nothing is written that no load could read (nor that the JSON plugin would read)."""
    with pytest.raises(cp.errors.PluginError, match="Cannot save checkpointable 'e'"):
        cp.save_checkpointables(tmp_path / "c", {"e": {"a": 1}})
    assert not (tmp_path / "c").exists()


_PLUGIN = """
    import checkpointables as cp

    class {cls}:
        async def save(self, directory, checkpointable): ...
        async def load(self, directory, abstract_checkpointable=None): return "{cls}"
        async def metadata(self, directory): ...
        def is_handleable(self, obj): return False
        def is_abstract_handleable(self, abstract): return None

    @cp.hookimpl
    def register_checkpointable_handlers(register):
        register({cls}, priority={priority}, typestr="shared.Typestr")
"""


def test_plugins_claiming_one_typestr_both_load_with_a_warning(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = []
    # Whichever sorts first, neither may read what the other wrote.
    for name, priority in (("aaa_claim", 90), ("zzz_claim", 10)):
        source = _PLUGIN.format(cls=f"{name.title().replace('_', '')}Handler", priority=priority)
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        eps.append(
            importlib_metadata.EntryPoint(name=name, value=name, group=plugins.ENTRY_POINT_GROUP)
        )
    with pytest.warns(RuntimeWarning, match="plugin 'aaa_claim' and .*plugin 'zzz_claim'"):
        found = plugins.discover(eps, disabled=set())
    assert [p.status for p in found.plugins] == ["loaded", "loaded"]
    claimants = plugins.contested_typestrs(found.handlers)["shared.Typestr"]
    assert [r.plugin for r in claimants] == ["aaa_claim", "zzz_claim"]
    with pytest.raises(cp.errors.PluginError, match="CHECKPOINTABLES_DISABLE_PLUGINS=aaa_claim"):
        cp.handlers.resolve_for_load(found.handlers, name="x", recorded_typestr="shared.Typestr")
    forced = claimants[1].handler_cls
    chosen, _ = cp.handlers.resolve_for_load(
        found.handlers, name="x", recorded_typestr="shared.Typestr", forced=forced
    )
    assert chosen is claimants[1]
