"""gpu_tail='auto''s tuner on scripted timings: grow while the GPU waits for the CPU, settle
at the knee, give memory back when the waiting stops (with hysteresis), regrow when it
returns."""

from __future__ import annotations

from hf_superoffload.engine.tail_tuner import GROW, PROBE, SETTLED, TailTuner

M = 1_000_000


class Script:
    """Feeds a tuner one step at a time, applying its moves at once (as TailMoves does), with
    a CPU Adam of 1 G elements per second over whatever is on the host."""

    def __init__(self, tuner: TailTuner, total: int = 100 * M, device: int = 0):
        self.tuner, self.total, self.device = tuner, total, device
        self.now = self.exposed = self.cpu = 0.0
        self.elements = 0
        self.moves: list[int] = []

    def step(self, wall: float, waited: float) -> int:
        host = self.total - self.device
        self.now, self.exposed = self.now + wall, self.exposed + waited
        self.cpu += host / 1e9
        self.elements += host
        move = self.tuner.decide(self.now, self.exposed, self.cpu, self.elements, host, self.device)
        if move:
            self.device += move
            self.moves.append(move)
        return move


def test_warm_up_steps_are_not_measured():
    script = Script(TailTuner(warmup_steps=3, samples=1))
    assert [script.step(1.0, 0.5) for _ in range(3)] == [0, 0, 0]
    assert script.tuner.phase == GROW


def test_grows_by_the_exposed_cpu_work_after_enough_samples():
    script = Script(TailTuner(warmup_steps=1, samples=2, max_share=0.5))
    script.step(1.0, 0.2)  # warm-up: its end starts the first sample
    assert script.step(1.0, 0.03) == 0  # sample 1 of 2
    assert script.step(1.0, 0.03) == 30 * M  # 0.03 s exposed x 1 G elements/s
    assert script.step(1.0, 0.0) == 0  # a baseline after the move: not a sample
    assert script.tuner.phase == GROW


def test_a_move_is_at_most_max_share_of_the_host_params():
    script = Script(TailTuner(warmup_steps=0, samples=1, max_share=0.25))
    script.step(1.0, 0.9)
    assert script.step(1.0, 0.9) == 25 * M


def test_settles_at_the_knee_the_smallest_tail_within_tolerance_of_the_best():
    # Step time by device elements: growth helps until 40M, beyond buys under 3%.
    times = {0: 1.50, 30 * M: 1.12, 60 * M: 1.10}
    waits = {0: 0.03, 30 * M: 0.03, 60 * M: 0.0}
    script = Script(TailTuner(warmup_steps=0, samples=1, knee_tolerance=0.03, max_share=0.5))
    for _ in range(8):
        script.step(times[script.device], waits[script.device])
        if script.tuner.phase == SETTLED:
            break
    assert script.moves == [30 * M, 30 * M, -30 * M]  # grew twice, gave the last move back
    assert script.device == 30 * M and script.tuner.phase == SETTLED
    assert not script.tuner.active


def test_settled_tuner_gives_half_the_tail_back_after_quiet_steps_and_keeps_it_if_as_fast():
    script = Script(TailTuner(warmup_steps=0, samples=2, quiet_steps=5), device=40 * M)
    script.tuner.settle("scripted")
    moves = [script.step(1.0, 0.0) for _ in range(6)]
    assert moves == [0] * 5 + [-20 * M]  # the first step has nothing before it to measure
    assert script.tuner.phase == PROBE and script.tuner.active
    script.step(1.0, 0.0)  # baseline after the give-back
    assert [script.step(1.01, 0.001) for _ in range(2)] == [0, 0]  # within 3%: kept
    assert script.device == 20 * M and script.tuner.phase == SETTLED


def test_a_failed_probe_takes_the_tail_back_and_waits_twice_as_long_next_time():
    script = Script(TailTuner(warmup_steps=0, samples=1, quiet_steps=3), device=40 * M)
    script.tuner.settle("scripted")
    for _ in range(4):  # the first has nothing before it; then 3 quiet steps
        script.step(1.0, 0.0)
    assert script.device == 20 * M
    script.step(1.0, 0.0)  # baseline
    assert script.step(1.2, 0.15) == 20 * M  # 20% slower: the tail comes back
    assert script.tuner.phase == SETTLED
    script.step(1.0, 0.0)  # baseline
    quiet = [script.step(1.0, 0.0) for _ in range(6)]
    assert quiet == [0] * 5 + [-20 * M]  # patience doubled from 3 to 6 quiet steps


def test_waiting_again_while_settled_regrows():
    script = Script(
        TailTuner(warmup_steps=0, samples=1, regrow_steps=3, max_share=0.5), device=10 * M
    )
    script.tuner.settle("scripted")
    script.step(1.0, 0.0)
    assert [script.step(1.3, 0.3) for _ in range(2)] == [0, 0]
    assert script.tuner.phase == SETTLED  # two waiting steps: not yet (hysteresis)
    assert script.step(1.3, 0.3) == 0 and script.tuner.phase == GROW
    assert script.step(1.3, 0.3) == 90 * M // 2  # min(0.3 s x 1 G/s, half the host params)


def test_one_waiting_sample_of_two_is_not_enough_to_grow():
    script = Script(TailTuner(warmup_steps=0, samples=2))
    script.step(1.0, 0.0)
    assert [script.step(1.5, 0.5), script.step(1.0, 0.0)] == [0, 0]  # a one-off wait
    assert script.tuner.phase == SETTLED


def test_max_moves_ends_growth_at_the_knee():
    script = Script(TailTuner(warmup_steps=0, samples=1, max_moves=2, max_share=0.1))
    for _ in range(6):
        script.step(1.0 - script.device / 1e9, 0.5)  # each move helps a little, always waits
    assert script.tuner.phase == SETTLED
    assert script.moves[:2] == [10 * M, 9 * M]
    assert "2 moves made" in script.tuner.last_reason
