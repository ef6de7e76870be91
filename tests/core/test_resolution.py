"""Handler resolution is a pure function of registrations: tested without disk."""

from __future__ import annotations

from typing import Any

import checkpointables as cp
import pytest
from checkpointables.plugins import make_handler_registration


class _Base:
    accepts: Any = object
    abstract_answer: bool | None = None

    async def save(self, directory: Any, checkpointable: Any) -> None: ...
    async def load(self, directory: Any, abstract_checkpointable: Any = None) -> None: ...
    async def metadata(self, directory: Any) -> None: ...

    def is_handleable(self, checkpointable: Any) -> bool:
        return isinstance(checkpointable, self.accepts)

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        return self.abstract_answer


class IntHandler(_Base):
    accepts = int


class NumberHandler(_Base):
    accepts = (int, float)


class AnythingHandler(_Base):
    accepts = object


class AbstractStrHandler(_Base):
    accepts = str

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        return isinstance(abstract_checkpointable, str)


class RefusesAbstractHandler(_Base):
    accepts = bytes
    abstract_answer = False


def reg(cls: type, priority: int, **kwargs: Any) -> cp.handlers.HandlerRegistration:
    return make_handler_registration(cls, plugin="test", priority=priority, **kwargs)


def ordered(*registrations: cp.handlers.HandlerRegistration) -> list[Any]:
    return sorted(registrations, key=lambda r: r.sort_key)


def test_save_takes_first_handleable_by_priority() -> None:
    regs = ordered(reg(AnythingHandler, 90), reg(NumberHandler, 60), reg(IntHandler, 50))
    chosen, instance = cp.handlers.resolve_for_save(regs, 3, name="x")
    assert chosen.handler_cls is IntHandler and isinstance(instance, IntHandler)
    chosen, _ = cp.handlers.resolve_for_save(regs, 2.5, name="x")
    assert chosen.handler_cls is NumberHandler
    chosen, _ = cp.handlers.resolve_for_save(regs, "s", name="x")
    assert chosen.handler_cls is AnythingHandler


def test_equal_priorities_are_ordered_by_name_not_registration_order() -> None:
    a = ordered(reg(NumberHandler, 50), reg(IntHandler, 50))
    b = ordered(reg(IntHandler, 50), reg(NumberHandler, 50))
    assert [r.name for r in a] == [r.name for r in b] == ["int", "number"]
    assert cp.handlers.resolve_for_save(a, 1, name="x")[0].handler_cls is IntHandler


def test_handler_scoped_to_a_name_wins_for_that_name_only() -> None:
    regs = ordered(reg(IntHandler, 10), reg(NumberHandler, 99, checkpointable_name="special"))
    assert cp.handlers.resolve_for_save(regs, 1, name="special")[0].handler_cls is NumberHandler
    assert cp.handlers.resolve_for_save(regs, 1, name="other")[0].handler_cls is IntHandler


def test_forced_handler_wins_and_must_accept_the_object() -> None:
    regs = ordered(reg(IntHandler, 10), reg(NumberHandler, 20))
    assert cp.handlers.resolve_for_save(regs, 1, name="x", forced=NumberHandler)[0].handler_cls is (
        NumberHandler
    )
    with pytest.raises(cp.errors.NoHandlerForObjectError, match="Checkpointable 'x' is saved by"):
        cp.handlers.resolve_for_save(regs, "text", name="x", forced=NumberHandler)


def test_unhandleable_object_error_names_checkpointable_type_and_handlers() -> None:
    regs = ordered(reg(IntHandler, 10), reg(NumberHandler, 20))
    with pytest.raises(cp.errors.NoHandlerForObjectError) as info:
        cp.handlers.resolve_for_save(regs, object(), name="weights")
    message = str(info.value)
    assert "'weights'" in message and "builtins.object" in message
    assert "int (" in message and "number (" in message


def test_save_rejects_none() -> None:
    with pytest.raises(ValueError, match="None"):
        cp.handlers.resolve_for_save([reg(AnythingHandler, 1)], None, name="x")


def test_load_uses_recorded_typestr_then_secondary() -> None:
    regs = ordered(reg(IntHandler, 10), reg(NumberHandler, 20, secondary_typestrs=["old.Number"]))
    recorded = cp.handlers.typestr(NumberHandler)
    assert cp.handlers.resolve_for_load(regs, name="x", recorded_typestr=recorded)[
        0
    ].handler_cls is (NumberHandler)
    assert (
        cp.handlers.resolve_for_load(regs, name="x", recorded_typestr="old.Number")[0].handler_cls
        is NumberHandler
    )


def test_abstract_redirects_when_recorded_handler_refuses_it() -> None:
    regs = ordered(reg(RefusesAbstractHandler, 10), reg(AbstractStrHandler, 20))
    recorded = cp.handlers.typestr(RefusesAbstractHandler)
    chosen, _ = cp.handlers.resolve_for_load(
        regs, name="x", recorded_typestr=recorded, abstract="abstract"
    )
    assert chosen.handler_cls is AbstractStrHandler


def test_undecided_abstract_defers_to_typestr() -> None:
    # NumberHandler answers None ("cannot tell"): the typestr decides, even though
    # AbstractStrHandler would take a str abstract.
    regs = ordered(reg(AbstractStrHandler, 10), reg(NumberHandler, 20))
    recorded = cp.handlers.typestr(NumberHandler)
    chosen, _ = cp.handlers.resolve_for_load(
        regs, name="x", recorded_typestr=recorded, abstract="abstract"
    )
    assert chosen.handler_cls is NumberHandler


def test_refused_abstract_with_no_taker_is_an_error() -> None:
    regs = [reg(RefusesAbstractHandler, 10)]
    with pytest.raises(cp.errors.MissingHandlerError, match="cannot load into"):
        cp.handlers.resolve_for_load(
            regs, name="x", recorded_typestr=cp.handlers.typestr(RefusesAbstractHandler), abstract=1
        )


def test_unknown_typestr_names_it_and_the_distribution_for_our_plugins() -> None:
    regs = [reg(IntHandler, 10)]
    with pytest.raises(cp.errors.MissingHandlerError) as info:
        cp.handlers.resolve_for_load(
            regs, name="state", recorded_typestr="checkpointables_grain.GrainHandler"
        )
    assert "checkpointables_grain.GrainHandler" in str(info.value)
    assert "pip install checkpointables-grain" in str(info.value)
    with pytest.raises(cp.errors.MissingHandlerError) as info:
        cp.handlers.resolve_for_load(regs, name="state", recorded_typestr="someone.Else")
    assert "someone.Else" in str(info.value) and "pip install" not in str(info.value)


def test_orbax_typestrs_map_to_our_distributions() -> None:
    hint = cp.handlers.install_hint(
        "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"
    )
    assert "checkpointables-pytree" in hint


def test_no_typestr_falls_back_to_recognizers_in_resolution_order() -> None:
    regs = ordered(reg(IntHandler, 10), reg(NumberHandler, 20))
    chosen, _ = cp.handlers.resolve_for_load(
        regs, name="x", recorded_typestr=None, recognizers={"number": True, "int": False}
    )
    assert chosen.handler_cls is NumberHandler
    with pytest.raises(cp.errors.MissingHandlerError, match="records no handler"):
        cp.handlers.resolve_for_load(regs, name="x", recorded_typestr=None, recognizers={})


def test_typestr_is_never_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    # A typestr naming a real module must not be imported to find a handler.
    import sys

    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    with pytest.raises(cp.errors.MissingHandlerError):
        cp.handlers.resolve_for_load(
            [reg(IntHandler, 1)], name="x", recorded_typestr="colorsys.rgb_to_hsv"
        )
    assert "colorsys" not in sys.modules


def test_registration_rejects_non_handlers() -> None:
    with pytest.raises(TypeError, match="not a CheckpointableHandler"):
        make_handler_registration(int, plugin="test")
    with pytest.raises(TypeError, match="pass the class"):
        make_handler_registration(IntHandler(), plugin="test")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "distribution",
    [
        "--index-url=http://evil.example",
        "good; rm -rf ~",
        "two words",
        "",
        "x" * 200,
        "name\nnewline",
        42,
        None,
    ],
)
def test_a_crafted_recorded_distribution_is_never_suggested(distribution) -> None:
    from checkpointables.checkpoint_metadata import recorded_distribution

    meta = {"checkpointables_handler_distributions": {"x": {"distribution": distribution}}}
    assert recorded_distribution(meta, "x") is None
    regs = [reg(IntHandler, 10)]
    with pytest.raises(cp.errors.MissingHandlerError) as info:
        cp.handlers.resolve_for_load(
            regs,
            name="x",
            recorded_typestr="someone.Else",
            distribution=recorded_distribution(meta, "x"),
        )
    assert "pip install" not in str(info.value)


def test_our_typestrs_name_our_distribution_whatever_the_checkpoint_records() -> None:
    hint = cp.handlers.install_hint(
        "checkpointables_proto.ProtoHandler", ("some-other-package", "6.6.6")
    )
    assert "pip install checkpointables-proto" in hint and "some-other-package" not in hint
    third_party = cp.handlers.install_hint("their_module.Handler", ("their-package", "1.2"))
    assert "pip install 'their-package==1.2'" in third_party
