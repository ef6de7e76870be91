"""Option classes that plugins add to ``cp.Context`` / ``cp.configure`` (``register_options``).

The pytree plugin owns the TensorStore and S3 settings (``array_options``,
``storage_options``); core knows them only as registered keywords.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import attrs
import checkpointables as cp
import checkpointables_pytree
import importlib_metadata
import pytest
from checkpointables import plugins
from checkpointables.context import get_context


def _ep(name: str, module: str) -> importlib_metadata.EntryPoint:
    return importlib_metadata.EntryPoint(name=name, value=module, group=plugins.ENTRY_POINT_GROUP)


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """Writes a plugin module registering ``register_options`` calls; returns its entry point."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, calls: str) -> importlib_metadata.EntryPoint:
        source = f"""
            import attrs
            import checkpointables as cp

            @attrs.frozen
            class TracingOptions:
                level: int = 0

            class NeedsArguments:
                def __init__(self, level): ...

            @cp.hookimpl
            def register_options(register):
                {calls}
        """
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return _ep(name, name)

    return write


def test_plugins_register_option_classes_under_keywords(plugin_module) -> None:
    ep = plugin_module("cpt_options_a", "register('tracing_options', TracingOptions)")
    found = plugins.discover([ep], disabled=set())
    (registration,) = found.options
    assert registration.keyword == "tracing_options" and registration.plugin == "cpt_options_a"
    assert registration.options_cls.__name__ == "TracingOptions"
    assert found.plugins[0].options == (registration,)


@pytest.mark.parametrize(
    ("calls", "error"),
    [
        ("register('tracing', TracingOptions)", "keyword like 'tracing_options'"),
        ("register('tracing_options', TracingOptions())", "takes an option class"),
        ("register('tracing_options', NeedsArguments)", "with no arguments"),
    ],
)
def test_bad_option_registrations_skip_the_plugin(plugin_module, calls, error) -> None:
    ep = plugin_module(f"cpt_options_bad_{abs(hash(calls))}", calls)  # A module per case.
    with pytest.warns(RuntimeWarning, match="failed to load"):
        found = plugins.discover([ep], disabled=set())
    assert found.plugins[0].status == "failed" and error in (found.plugins[0].error or "")
    assert found.options == ()


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_keyword_two_plugins_register_is_given_to_neither(plugin_module, order) -> None:
    # Which one the user meant cannot be told; entry-point order must not decide it.
    eps = [
        plugin_module("cpt_options_first", "register('tracing_options', TracingOptions)"),
        plugin_module("cpt_options_second", "register('tracing_options', TracingOptions)"),
    ]
    with pytest.warns(RuntimeWarning, match="under the keyword 'tracing_options'"):
        found = plugins.discover([eps[i] for i in order], disabled=set())
    assert found.options == ()
    assert {p.status for p in found.plugins} == {"failed"}


@pytest.mark.parametrize("first", [True, False])
def test_a_third_party_taking_a_keyword_of_ours_is_refused_in_either_order(
    plugin_module, first
) -> None:
    taker = plugin_module("cpt_takes_storage", "register('storage_options', TracingOptions)")
    installed = importlib_metadata.entry_points(group=plugins.ENTRY_POINT_GROUP)
    ours = [ep for ep in installed if ep.name == "pytree"]
    with pytest.warns(RuntimeWarning, match="which belongs to checkpointables_pytree"):
        found = plugins.discover([taker, *ours] if first else [*ours, taker], disabled=set())
    status = {p.name: p.status for p in found.plugins}
    assert status == {"pytree": "loaded", "cpt_takes_storage": "failed"}
    (storage,) = [r for r in found.options if r.keyword == "storage_options"]
    assert storage.plugin == "pytree"


def test_the_pytree_plugin_owns_the_tensorstore_and_s3_settings() -> None:
    # The public names keep working, and are the plugin's classes.
    assert cp.options.StorageOptions is checkpointables_pytree.StorageOptions
    assert cp.options.ArrayOptions is checkpointables_pytree.ArrayOptions
    assert cp.options.ArrayStorageOptions is checkpointables_pytree.ArrayStorageOptions
    assert cp.options.StorageOptions.__module__.startswith("checkpointables_pytree.")
    assert not hasattr(cp.options, "NoSuchOptions")
    with pytest.raises(AttributeError, match="installed plugin registers"):
        cp.options.NoSuchOptions  # noqa: B018
    keywords = {r.keyword: r.plugin for r in plugins.option_registrations()}
    assert keywords["storage_options"] == keywords["array_options"] == "pytree"


def test_plugin_keywords_work_in_context_and_configure() -> None:
    storage_options = checkpointables_pytree.StorageOptions(region="eu-west-3")
    with cp.Context(storage_options=storage_options) as context:
        assert context.storage_options is storage_options
        assert context.options(checkpointables_pytree.StorageOptions) is storage_options
        assert get_context().options(cp.options.AsyncOptions) == cp.options.AsyncOptions()
        with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=5)):
            assert get_context().storage_options.region == "eu-west-3"  # Inherited.
        assert "storage_options=StorageOptions(" in repr(context)
    assert get_context().storage_options == checkpointables_pytree.StorageOptions()
    array_options = checkpointables_pytree.ArrayOptions(use_compression=True)
    cp.configure(array_options=array_options)
    try:
        assert get_context().array_options is array_options
    finally:
        cp.configure(array_options=checkpointables_pytree.ArrayOptions())
    with pytest.raises(TypeError, match=r"must be a StorageOptions \(of plugin 'pytree'\)"):
        cp.Context(storage_options=attrs.evolve(array_options))
    with pytest.raises(TypeError, match="Unknown option 'stroage_options'.*storage_options"):
        cp.Context(stroage_options=storage_options)
    with pytest.raises(TypeError, match="not an option class"):
        get_context().options(dict)
    with pytest.raises(AttributeError, match="no_options"):
        get_context().no_options  # noqa: B018


def test_option_lookups_discover_plugins_only_when_needed() -> None:
    code = """
        import sys
        import checkpointables as cp, checkpointables.plugins as p
        with cp.Context(async_options=cp.options.AsyncOptions(timeout_secs=3)) as c:
            assert c.async_options.timeout_secs == 3 and c.options(cp.options.FileOptions)
        cp.configure(file_options=cp.options.FileOptions())
        assert p._cached is None and "checkpointables_pytree" not in sys.modules
        cp.options.StorageOptions  # A plugin's class: found by discovery.
        assert p._cached is not None
        p.refresh()
        cp.Context(array_options=None)  # A plugin's keyword: discovered before it is checked.
        assert p._cached is not None
    """
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True)
