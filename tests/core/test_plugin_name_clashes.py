"""A handler name two plugins register: who keeps it never depends on entry-point order.

The plugins here are real distributions (a ``.dist-info`` with ``entry_points.txt`` on
``sys.path``), found by ``importlib_metadata`` next to the installed ones, as pip would
install them.
"""

from __future__ import annotations

import re
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
from checkpointables import plugins

from .test_plugins import _GOOD

# test_plugins' one-handler plugin, registering its handler under a given name.
_PLUGIN = _GOOD.replace("priority={priority}", "name={name!r}")


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Installs a one-handler plugin as a distribution with an entry point; returns it."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(distribution: str, entry_point: str, module: str, cls: str, name: str) -> None:
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(_PLUGIN.format(cls=cls, name=name)))
        info = tmp_path / f"{distribution.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n"
        )
        (info / "entry_points.txt").write_text(f"[checkpointables]\n{entry_point} = {module}\n")

    return install


def _discover() -> tuple[dict[str, plugins.PluginInfo], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = plugins.discover(disabled=set())
    return {p.name: p for p in found.plugins}, [str(w.message) for w in caught]


@pytest.mark.parametrize("entry_point", ["badreg", "zbadreg"])  # Before and after 'json'.
def test_a_third_party_taking_a_name_of_ours_is_refused_in_either_order(
    install, entry_point
) -> None:
    install("badreg-dist", entry_point, f"cpt_{entry_point}", "DummyHandler", "json")
    infos, messages = _discover()
    assert infos["json"].status == "loaded"
    assert [h.name for h in infos["json"].handlers] == ["json"]
    assert infos[entry_point].status == "failed"
    (message,) = [m for m in messages if "'json'" in m]
    # It blames the plugin that took the name, by entry point and distribution, names the
    # class that runs (not Orbax's typestr it records), and says what to do.
    assert message.startswith(
        f"checkpointables plugin {entry_point!r} (cpt_{entry_point}) from distribution "
        f"badreg-dist is skipped: it registers its handler cpt_{entry_point}.DummyHandler "
        f"under the name 'json', which belongs to checkpointables_json.JsonHandler of "
        f"checkpointables' own plugin 'json' (checkpointables-json)"
    )
    assert "register(..., name='...')" in message
    assert f"CHECKPOINTABLES_DISABLE_PLUGINS={entry_point}" in message
    assert "orbax" not in message
    assert re.search(r"(?<!\.)\.\.(?!\.)", message) is None  # No double full stop.


@pytest.mark.parametrize("order", [("aaa", "zzz"), ("zzz", "aaa")])
def test_two_third_parties_sharing_a_name_are_both_refused(install, order) -> None:
    first, second = order
    # Module names differ between the orders: each run imports its own modules.
    install("points-one", first, f"cpt_{first}_one", "PointHandler", "point")
    install("points-two", second, f"cpt_{second}_two", "OtherPointHandler", "point")
    infos, messages = _discover()
    assert infos[first].status == infos[second].status == "failed"
    for ep in order:
        (message,) = [m for m in messages if m.startswith(f"checkpointables plugin {ep!r}")]
        assert "under the name 'point'" in message and "every plugin registering it" in message
    # Each names the other, by class and distribution, and says how to keep either.
    assert f"cpt_{second}_two.OtherPointHandler of plugin {second!r}" in infos[first].error
    assert "(points-one)" in infos[second].error
    assert f"CHECKPOINTABLES_DISABLE_PLUGINS={second}; to keep the other" in infos[first].error
    # Blocking one gives the name to the other.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = plugins.discover(disabled={"zzz"})
    assert {p.name: p.status for p in kept.plugins}["aaa"] == "loaded"
    assert "point" in {h.name for h in kept.handlers}


_TAKES_OURS = """
import checkpointables as cp
import numpy as np
from checkpointables_pytree.leaves import NumpyLeafHandler


class EvilNumpy(NumpyLeafHandler):
    pass


class TheirReader:
    def recognizes(self, path):
        return str(path).endswith(".safetensors")

    async def load(self, path, abstract_pytree=None):
        raise RuntimeError("their reader")

    async def metadata(self, path):
        raise RuntimeError("their reader")


def gs_storage(*args, **kwargs):
    raise RuntimeError("their gs://")


@cp.hookimpl
def register_{hook}(register):
    {call}
"""


@pytest.mark.parametrize("theirs_first", [True, False])
@pytest.mark.parametrize(
    ("hook", "call", "ours", "said"),
    [
        (
            "leaf_handlers",
            "register(np.ndarray, np.ndarray, EvilNumpy)",
            "pytree",
            "leaf type 'numpy.ndarray', which belongs to checkpointables_pytree",
        ),
        (  # Our class, registered differently: what it writes and reads would change.
            "leaf_handlers",
            "register(np.ndarray, dict, NumpyLeafHandler, secondary_typestrs=())",
            "pytree",
            "leaf type 'numpy.ndarray', which belongs to checkpointables_pytree",
        ),
        ("storage", "register('gs', gs_storage)", "pytree", "URL scheme 'gs', which belongs"),
        (
            "pytree_readers",
            "register(TheirReader, priority=0, name='safetensors')",
            "safetensors",
            "name 'safetensors', which belongs to checkpointables_safetensors",
        ),
    ],
    ids=["leaf type", "our leaf class otherwise", "storage scheme", "reader name"],
)
def test_a_third_party_taking_a_leaf_type_scheme_or_reader_of_ours_is_refused(
    tmp_path, monkeypatch, theirs_first, hook, call, ours, said
) -> None:
    import importlib_metadata
    from checkpointables.serialization import StandardLeafHandlerRegistry

    module = f"cpt_takes_{hook}_{abs(hash(call))}_{int(theirs_first)}"
    (tmp_path / f"{module}.py").write_text(_TAKES_OURS.format(hook=hook, call=call))
    monkeypatch.syspath_prepend(str(tmp_path))
    theirs = importlib_metadata.EntryPoint(
        name="their", value=module, group=plugins.ENTRY_POINT_GROUP
    )
    installed = importlib_metadata.entry_points(group=plugins.ENTRY_POINT_GROUP)
    our_eps = [ep for ep in installed if ep.name in {"pytree", ours}]
    eps = [theirs, *our_eps] if theirs_first else [*our_eps, theirs]
    with pytest.warns(RuntimeWarning, match=said):
        found = plugins.discover(eps, set())
    assert {p.name: p.status for p in found.plugins} == {
        **{ep.name: "loaded" for ep in our_eps},
        "their": "failed",
    }
    monkeypatch.setattr(plugins, "_cached", found)
    assert plugins.storage_factories()["gs"].__module__.startswith("checkpointables_pytree")
    assert (
        StandardLeafHandlerRegistry()
        .get(np.ndarray)
        .__module__.startswith("checkpointables_pytree")
    )
    readers = {r.name: r.reader_cls for r in found.readers}
    assert "TheirReader" not in {cls.__name__ for cls in readers.values()}
