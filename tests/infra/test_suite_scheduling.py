"""The suite's own scheduling (tests/fixtures/scheduling.py, tests/durations.py): what `make test`'s
two workers are handed."""

from durations import parse
from fixtures.scheduling import SLURM_MODULES, SLURM_SCOPE, scope_of


def test_durations_add_up_setup_call_and_teardown_per_test():
    log = """============================= slowest durations =============================
12.50s setup    tests/flows/test_full_lifecycle.py::test_no_path_is_written_by_both_nodes
0.20s call     tests/flows/test_full_lifecycle.py::test_no_path_is_written_by_both_nodes
1.00s call     tests/parallel/test_par2_layouts.py::test_world2_layouts_match_one_process[a b]
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
"""
    assert parse(log) == {"tests/flows/test_full_lifecycle.py::test_no_path_is_written_by_both_nodes": 12.7,
                          "tests/parallel/test_par2_layouts.py::test_world2_layouts_match_one_process[a b]": 1.0}


def test_a_module_is_one_scope_and_the_slurm_modules_share_one():
    assert scope_of("tests/infra/test_lease.py::test_x[1]") == scope_of("tests/infra/test_lease.py::test_y")
    assert scope_of("tests/infra/test_lease.py::test_x") != scope_of("tests/infra/test_store.py::test_x")
    assert {scope_of(f"{m}::test_x") for m in SLURM_MODULES} == {SLURM_SCOPE}
