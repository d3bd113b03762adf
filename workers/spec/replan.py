"""How often a batch is planned: every step, until its plans keep coming out empty.

Planning a step has a price of its own (at 16 sequences on the demo pair about 0.3 ms of a 10 ms step, at 32
about 0.4 ms of 14 ms), and where speculation does not pay every plan comes out empty - zero draft tokens for
every sequence - and that price buys nothing. After EMPTY_STREAK empty plans in a row for one batch key
(goodput_guard.Key: batch-size bucket, prefill or not, proposers), the key is planned every 2, 4, 8, then
MAX_INTERVAL steps; the first plan that drafts anything resets it. The steps between decode plainly, as those
plans would have chosen. Costs and acceptance move over tens of steps, so a batch whose speculation starts to
pay drafts again within MAX_INTERVAL steps.

A proposer's costs and acceptance are learnt only from steps that draft: one probed while another process held
the core, or a prior that started low, would make every plan empty for good and never be corrected (an EAGLE
head whose cost table read 5x its true cost drafted nothing over five 128-token requests). So every
PROBE_EVERY-th empty plan in a row of a key is a probe: it drafts anyway, each of at most PROBE_MAX_SEQS
sequences its tree or its longest chain, whose timings and verdicts feed the tables and acceptance like any
other: those with the least to catch up on (a quiet key's proposer took no prompt in and saw no token since it
last drafted, and a probe pays each drafting sequence's backlog). A probe of all 16 sequences of a demo batch
took 43-87 ms against a 5 ms plain step, and engines whose policy drafted next to nothing there ran 5-12 %
below plain decoding; bounded to 4, an EAGLE tree engine ran at 0.94-0.95x plain against 0.88-0.90x, a draft
chain engine 0.98-0.99x against 0.94-0.95x (2-core AVX-512 host, 2026-12-06; README, "Planning less where it
keeps choosing nothing"). The goodput guard is not told of it: it judges the policy's plans, and a probe
also pays what the proposer skipped while the key was quiet (the prompts it did not take in), which no plan
of a key that drafts pays. A probe after which the key's plans still draft nothing found the tables right:
the next one comes twice as many empty plans on (8, 16, 32, 64, then every MAX_PROBE_GAP), so where speculation
really does not pay a probe is one drafting step in about MAX_INTERVAL * MAX_PROBE_GAP, and one that does pay
again is found within that (a plan that drafts starts the count again). At 4 sequences in flight (8 prompts
cycled, stepped in turn with plain decoding, three rounds, 2026-12-06): a draft tree engine 0.966-0.979x plain
against 0.944-0.953x probing every 8th empty plan, an EAGLE tree 0.949-0.975x against 0.935-0.943x, a draft
chain the same (0.967-0.977x); at one sequence all within their noise (EAGLE chain 1.82-1.91x either way).
"""

from dataclasses import dataclass

from workers.spec.goodput_guard import Key

EMPTY_STREAK = 4  # empty plans in a row before a key is planned less often
MAX_INTERVAL = 16  # steps between its plans at the most
PROBE_EVERY = 8  # every 8th empty plan in a row drafts anyway (a probe)
PROBE_MAX_SEQS = 4  # sequences a probe drafts for, at most
MAX_PROBE_GAP = 64  # empty plans between two probes of a key, at most


def probe_picks(num_behind: list[int]) -> list[int]:
    """Which of a batch's sequences a probe drafts for: the PROBE_MAX_SEQS with the fewest tokens their proposer
    has not seen (num_behind, one per sequence), the earlier of a tie first; their indices, in batch order."""
    ranked = sorted(range(len(num_behind)), key=lambda i: (num_behind[i], i))
    return sorted(ranked[:PROBE_MAX_SEQS])


@dataclass
class _Streak:
    num_empty: int = 0  # empty plans in a row
    steps_since_plan: int = 0
    next_probe: int = PROBE_EVERY  # the empty plan in a row that is the next probe


class Replan:
    def __init__(self) -> None:
        self._keys: dict[Key, _Streak] = {}

    @staticmethod
    def interval(num_empty: int) -> int:
        """Steps from one plan of a key to its next, after num_empty empty plans in a row."""
        if num_empty < EMPTY_STREAK:
            return 1
        return min(MAX_INTERVAL, 2 ** (num_empty - EMPTY_STREAK + 1))

    def is_due(self, key: Key) -> bool:
        """Should this step of `key` be planned? Called once per step that may be planned."""
        streak = self._keys.get(key)
        if streak is None:
            return True
        streak.steps_since_plan += 1
        return streak.steps_since_plan >= self.interval(streak.num_empty)

    def is_quiet(self, key: Key) -> bool:
        """Have `key`'s plans drafted nothing EMPTY_STREAK times in a row (it is planned less often)?"""
        streak = self._keys.get(key)
        return streak is not None and streak.num_empty >= EMPTY_STREAK

    def is_probe_due(self, key: Key) -> bool:
        """Should the plan just recorded for `key`, empty, draft anyway: is it the key's next probe (the
        PROBE_EVERY-th empty plan in a row, then twice as far on after each probe that changed nothing, at most
        MAX_PROBE_GAP plans on)?"""
        streak = self._keys.get(key)
        return streak is not None and streak.num_empty == streak.next_probe

    def record(self, key: Key, is_empty: bool) -> None:
        """A plan of `key` was made; is_empty: it drafted nothing."""
        streak = self._keys.setdefault(key, _Streak())
        streak.steps_since_plan = 0
        if not is_empty:
            streak.num_empty, streak.next_probe = 0, PROBE_EVERY
            return
        if streak.num_empty == streak.next_probe:  # the plan after a probe drafts nothing either
            streak.next_probe += min(streak.next_probe, MAX_PROBE_GAP)
        streak.num_empty += 1
