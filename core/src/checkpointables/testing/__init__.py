"""A conformance suite for checkpointable handlers, for plugin authors.

Subclass :class:`HandlerConformance` in your plugin's tests (pytest) and fill
in what it asks for; every test then runs against your handler through the
public API, with real files in ``tmp_path``::

    from checkpointables.testing import HandlerConformance

    class TestPointHandler(HandlerConformance):
        handler_name = "point"

        def make_checkpointables(self):
            return [Point(1, 2), Point(3.5, -1)]

        def make_unhandleable(self):
            return ["not a point", 3]
"""

from checkpointables.testing._conformance import HandlerConformance
from checkpointables.testing._subprocess import missing_handler_message

__all__ = ["HandlerConformance", "missing_handler_message"]
