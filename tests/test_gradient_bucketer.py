"""The gradient bucketer's order: units launch in index order as their last gradient is ready, and
finish in that order; a unit whose launch started nothing (one replica) finishes at once, not when
the next unit launches, so what waits for its gradients (a step during backward) does not wait for
the next unit's."""
from zkit.zero.buckets import GradientBucketer


class Handle:
    def __init__(self, log, unit):
        self.log, self.unit = log, unit

    def wait(self):
        self.log.append(("wait", self.unit))


def run(asynchronous: bool) -> list[tuple[str, int]]:
    log: list[tuple[str, int]] = []

    def launch(unit):
        log.append(("launch", unit))
        return Handle(log, unit) if asynchronous else None

    bucketer = GradientBucketer([2, 1, 1], launch, lambda unit: log.append(("finish", unit)))
    for unit in (0, 0, 1, 2):
        log.append(("ready", unit))
        bucketer.ready(unit)
    bucketer.flush()
    return log


def test_a_unit_with_nothing_in_flight_finishes_as_it_launches():
    assert run(asynchronous=False) == [
        ("ready", 0), ("ready", 0), ("launch", 0), ("finish", 0),
        ("ready", 1), ("launch", 1), ("finish", 1),
        ("ready", 2), ("launch", 2), ("finish", 2),
    ]


def test_collectives_in_flight_finish_in_order_at_flush():
    log = run(asynchronous=True)
    assert [e for e in log if e[0] == "launch"] == [("launch", 0), ("launch", 1), ("launch", 2)]
    assert log[-6:] == [("wait", 0), ("finish", 0), ("wait", 1), ("finish", 1), ("wait", 2), ("finish", 2)]
