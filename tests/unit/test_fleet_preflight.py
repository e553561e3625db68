"""The check before launch's judgement without a launch: the circle method pairs every rank once, the verdict names
what is below its floor, and a second pass confirms what a first pass named (a passing load names nothing, a slow GPU
or link is named in every pass). The passes' figures are those a 4-rank CPU check printed under the suite's load."""
import itertools

from pretrain.fleet.detector import Place
from pretrain.fleet.preflight import confirmed, rounds, verdict

WHERE = [Place("vm", gpu) for gpu in range(4)]
EVEN_GEMM = [0.082, 0.079, 0.084, 0.081]
EVEN_LINKS = {pair: 1.3 for pair in itertools.combinations(range(4), 2)}


def judge(figures):
    return verdict(*figures, WHERE, 0.6, 0.25)


def passes(*figures):
    """measure() that returns the given passes in order and counts its calls."""
    calls = []

    def measure():
        calls.append(len(calls))
        return figures[len(calls) - 1]
    return measure, calls


def test_rounds_pair_every_item_once_in_disjoint_rounds():
    for n in range(2, 9):
        seen = [pair for r in rounds(n) for pair in r]
        assert sorted(seen) == list(itertools.combinations(range(n), 2)), n
        assert all(len({x for pair in r for x in pair}) == 2 * len(r) for r in rounds(n))


def test_a_link_slow_in_one_pass_only_is_not_named_and_a_second_pass_is_run():
    burst = {**EVEN_LINKS, (0, 3): 0.302}          # 23% of the median: what a burst of load once gave
    assert judge((EVEN_GEMM, burst))[1]                      # named by one pass alone
    measure, calls = passes((EVEN_GEMM, burst), (EVEN_GEMM, EVEN_LINKS))
    line, slow = confirmed(measure, judge, confirm=1)
    assert not slow and len(calls) == 2
    assert line.startswith("preflight: 4 ranks even") and "6 links even" in line and "the best of 2 passes" in line


def test_a_slow_gpu_is_named_in_every_pass_and_stays_named():
    slow_gemm = [0.082, 0.026, 0.084, 0.081]
    measure, calls = passes((slow_gemm, EVEN_LINKS), (slow_gemm, EVEN_LINKS), (slow_gemm, EVEN_LINKS))
    line, slow = confirmed(measure, judge, confirm=2)
    assert slow and len(calls) == 3
    assert line.startswith("preflight: slow: rank 1 (host vm, GPU 1) GEMM TFLOP/s 0.026") and "rank 0 " not in line
    assert line.endswith("(the best of 3 passes)")


def test_an_even_first_pass_costs_no_second_and_confirm_0_judges_one_pass():
    measure, calls = passes((EVEN_GEMM, EVEN_LINKS))
    line, slow = confirmed(measure, judge, confirm=1)
    assert not slow and len(calls) == 1 and "passes" not in line
    burst = {**EVEN_LINKS, (1, 2): 0.2}
    measure, calls = passes((EVEN_GEMM, burst))
    line, slow = confirmed(measure, judge, confirm=0)
    assert slow and len(calls) == 1 and "link rank 1 ↔ rank 2 (vm ↔ vm) GB/s 0.2 " in line
