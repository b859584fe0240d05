"""Cache path == full forward on the `modes` config (the released mode pattern in miniature)."""

from tests.step_equivalence_suite import EquivalenceSuite, run  # noqa: F401 (the class fixture)


class TestModes(EquivalenceSuite):
    CONFIG = "modes"
