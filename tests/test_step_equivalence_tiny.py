"""Cache path == full forward on the `tiny` config (every mode, Engram, candidates); see the suite."""

from tests.step_equivalence_suite import EquivalenceSuite, run  # noqa: F401 (the class fixture)


class TestTiny(EquivalenceSuite):
    CONFIG = "tiny"
