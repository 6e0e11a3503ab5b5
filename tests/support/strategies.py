"""The random-schedule strategies moved into the package (pipec.testing.orders); tests import them from here."""

from pipec.testing.orders import (  # noqa: F401 - re-exported for the tests
    COMM_MUTATIONS,
    COMPUTE_MUTATIONS,
    MUTATIONS,
    STRUCTURAL,
    broken_programs,
    mutated,
    naive_lowering,
    placements,
    random_program,
    valid_programs,
)
