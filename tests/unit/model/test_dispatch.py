"""The kernel registry's blocks (model/ops/dispatch.py): `only` runs exactly the kernels it is
given, whatever is registered, and leaves the registry as it was, including what was
registered inside it."""

from model.ops import dispatch


def test_only_runs_exactly_the_given_kernels_and_restores_the_registry():
    dispatch.register("test_op", lambda x: ("registered", x))
    try:
        with dispatch.only({}):
            assert dispatch.call("test_op", 1) is None and dispatch.registered() == ()
        with dispatch.only({"test_op": lambda x: ("given", x)}):
            assert dispatch.call("test_op", 2) == ("given", 2)
            dispatch.register("inside", lambda: "inside")  # e.g. a build installing kernels
        with dispatch.kernels_enabled(False), dispatch.only({"test_op": lambda x: x}):
            assert dispatch.call("test_op", 3) == 3  # `only` turns its kernels on
        assert dispatch.call("test_op", 4) == ("registered", 4)
        assert "inside" not in dispatch.registered()
    finally:
        dispatch.unregister("test_op")
