"""What a ``NoHandlerForObjectError`` of a forced handler tells the user to do."""

from __future__ import annotations

import checkpointables as cp
import pytest


def test_save_pytree_of_a_non_pytree_says_what_to_call_instead(tmp_path) -> None:
    with pytest.raises(cp.errors.NoHandlerForObjectError) as raised:
        cp.save_pytree(tmp_path / "c", object())
    message = str(raised.value)
    # The option's real name and what dropping it does; no cryptic "force no handler".
    assert "force no handler" not in message
    assert "cp.save_checkpointables({'pytree': obj})" in message
    assert "create_with_handlers(pytree=...)" in message
    assert not (tmp_path / "c").exists()
