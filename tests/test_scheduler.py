"""Scheduler bookkeeping (CPU only, no model): admission, page growth, preemption, sliding-window
recycling, retirement, chaining and abort. The tests play the engine's part themselves: a prefill or
a decode step is one token appended to `output_ids`, and a sequence finishes when they say so."""

import random

import pytest
import torch

from qwen3_flex_inference import BatchSlots, PageTable, Scheduler, Sequence, pool_pages

FULL = "full_attention"
SLIDING = "sliding_attention"
PAGE_SIZE = 16
WINDOW = 24
FULL_ONLY = {FULL: None}
FULL_AND_SLIDING = {FULL: None, SLIDING: WINDOW}


def admit(scheduler, max_tokens=None):
    """Scheduler.admit for sequences that share no prompt: the admitted ones (there are no forks)."""
    admitted, forks = scheduler.admit(max_tokens)
    assert forks == [], f"{forks=}"
    return admitted


def make_scheduler(
    max_batch_size=3,
    max_seq_length=128,
    n_pages=10,
    page_size=PAGE_SIZE,
    windows=None,
    max_prefill_tokens=8192,
    pool_sizes=None,
) -> Scheduler:
    """A scheduler over one CPU page table per regime; `pool_sizes` overrides a regime's pool size."""
    windows = dict(windows or FULL_ONLY)
    pool_sizes = pool_sizes or {}
    tables = {
        regime: PageTable(
            page_size,
            pool_sizes.get(regime, pool_pages(n_pages, window, max_batch_size, page_size)),
            max_batch_size + 1,
            max_seq_length,
            "cpu",
        )
        for regime, window in windows.items()
    }
    return Scheduler(tables, windows, max_batch_size, max_seq_length, max_prefill_tokens)


def make_seq(num_tokens: int, max_new_tokens: int = 1000) -> Sequence:
    return Sequence(input_ids=list(range(3, 3 + num_tokens)), max_new_tokens=max_new_tokens)


def grow(seq: Sequence, num_tokens: int = 1) -> None:
    """The engine's part: `num_tokens` generated tokens."""
    seq.output_ids.extend([5] * num_tokens)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def stored_blocks(table: PageTable, batch_idx: int) -> list[int]:
    """Logical blocks of slot `batch_idx` that hold a physical page."""
    return [block for block, page in enumerate(table.pages_of[batch_idx]) if page is not None]


def pages_owned(scheduler: Scheduler, seq: Sequence) -> dict[str, list]:
    return {regime: list(table.pages_of[seq.batch_idx]) for regime, table in scheduler.page_tables.items()}


def check_pools(scheduler: Scheduler) -> None:
    """Every pool: free + used == total (page 0 reserved), no page owned twice or both free and owned,
    page 0 never handed out, and only slots with a holder own pages."""
    for regime, table in scheduler.page_tables.items():
        total = table.n_pages - 1
        free, used = table.num_free_pages, table.num_used_pages
        assert free + used == total, f"{regime}: {free=} + {used=} != {total=}"
        owned = [page for pages in table.pages_of for page in pages if page is not None]
        assert len(owned) == len(set(owned)), f"{regime}: a page is owned twice: {sorted(owned)}"
        assert len(table.free_pages) == len(set(table.free_pages)), f"{regime}: a page is free twice"
        assert 0 not in owned and 0 not in table.free_pages, f"{regime}: page 0 was handed out"
        both = set(owned) & set(table.free_pages)
        assert not both, f"{regime}: pages both free and owned: {both}"
        owning = {batch_idx for batch_idx, pages in enumerate(table.pages_of) if any(p is not None for p in pages)}
        assert owning <= set(scheduler.holders), f"{regime}: {owning=} but holders={sorted(scheduler.holders)}"


def check_slots(scheduler: Scheduler, max_batch_size: int) -> None:
    free = list(scheduler.slots.free_slots)
    held = set(scheduler.holders)
    assert len(free) == len(set(free)), f"a slot is free twice: {free=}"
    assert 0 not in held and 0 not in free, f"slot 0 was handed out: {held=} {free=}"
    assert not held & set(free), f"slots both held and free: {held & set(free)}"
    assert len(held) + len(free) == max_batch_size, f"{held=} {free=} {max_batch_size=}"
    for batch_idx, seq in scheduler.holders.items():
        assert seq.batch_idx == batch_idx, f"holders[{batch_idx}] has batch_idx {seq.batch_idx}"


def check_covers(scheduler: Scheduler, seq: Sequence, query_pos: int) -> None:
    """`seq`'s pages hold all its tokens in a full pool, and in a windowed pool every block from the
    window's left edge (for a query at `query_pos`) to its last token."""
    for regime, table in scheduler.page_tables.items():
        first_block = scheduler.first_needed_pos(regime, query_pos) // table.page_size
        last_block = ceil_div(seq.seq_len, table.page_size)
        pages = table.pages_of[seq.batch_idx]
        missing = [block for block in range(first_block, last_block) if block >= len(pages) or pages[block] is None]
        assert not missing, f"{regime}: {seq.seq_len=} {query_pos=} blocks {missing} have no page ({pages=})"


def all_free(scheduler: Scheduler, max_batch_size: int) -> None:
    for regime, table in scheduler.page_tables.items():
        free, used = table.num_free_pages, table.num_used_pages
        assert free == table.n_pages - 1 and used == 0, f"{regime}: {free=} {used=} n_pages={table.n_pages}"
    assert scheduler.slots.num_free == max_batch_size, f"{scheduler.slots.num_free=} {max_batch_size=}"
    assert not scheduler.holders, f"{scheduler.holders=}"


# ---------------------------------------------------------------------------------------------
# admit
# ---------------------------------------------------------------------------------------------


def test_admit_takes_waiting_in_order_and_stops_at_the_first_that_does_not_fit():
    scheduler = make_scheduler(max_batch_size=3, n_pages=10)  # 9 usable pages
    first, too_big, small = make_seq(20), make_seq(120), make_seq(5)  # 2, 8, 1 pages
    scheduler.add([first, too_big, small])
    admitted = admit(scheduler)
    assert admitted == [first], f"{[s.seq_len for s in admitted]=}"
    waiting = [s.seq_len for s in scheduler.waiting]
    assert waiting == [120, 5], f"no skipping ahead: {waiting=}"
    assert small.batch_idx == -1 and too_big.batch_idx == -1, f"{small.batch_idx=} {too_big.batch_idx=}"
    again = admit(scheduler)
    assert again == [], f"the head still does not fit: {[s.seq_len for s in again]=}"


def test_admit_stops_when_no_batch_slot_is_free():
    scheduler = make_scheduler(max_batch_size=3, n_pages=40)
    seqs = [make_seq(5) for _ in range(5)]
    scheduler.add(seqs)
    admitted = admit(scheduler)
    assert admitted == seqs[:3], f"{len(admitted)=}"
    assert list(scheduler.waiting) == seqs[3:], f"{len(scheduler.waiting)=}"
    assert scheduler.slots.num_free == 0, f"{scheduler.slots.num_free=}"


@pytest.mark.parametrize("max_tokens, want_admitted", [(19, 1), (20, 2), (29, 2), (30, 3), (None, 3)])
def test_admit_keeps_the_admitted_tokens_within_max_tokens(max_tokens, want_admitted):
    scheduler = make_scheduler(max_batch_size=4, n_pages=20)
    seqs = [make_seq(10) for _ in range(3)]
    scheduler.add(seqs)
    admitted = admit(scheduler, max_tokens)
    got = len(admitted)
    assert got == want_admitted, f"{max_tokens=}: {got=} {want_admitted=}"
    assert admitted == seqs[:got], "admitted out of order"
    num_tokens = sum(s.seq_len for s in admitted)
    assert max_tokens is None or num_tokens <= max_tokens, f"{num_tokens=} {max_tokens=}"


def test_admit_gives_distinct_nonzero_slots_and_pages_covering_the_tokens():
    scheduler = make_scheduler(max_batch_size=3, n_pages=20, windows=FULL_AND_SLIDING)
    seqs = [make_seq(n) for n in (1, 16, 17, 40)]
    scheduler.add(seqs)
    admitted = admit(scheduler)
    assert admitted == seqs[:3], f"{len(admitted)=}"
    slots = [s.batch_idx for s in admitted]
    assert len(set(slots)) == 3 and 0 not in slots, f"{slots=}"
    assert scheduler.holders == {s.batch_idx: s for s in admitted}, f"{scheduler.holders=} {slots=}"
    full = scheduler.page_tables[FULL]
    for seq in admitted:
        got, want = full.num_pages_of(seq.batch_idx), ceil_div(seq.seq_len, PAGE_SIZE)
        assert got == want, f"{seq.seq_len=}: {got=} {want=}"
        check_covers(scheduler, seq, seq.seq_len)
    check_pools(scheduler)
    check_slots(scheduler, 3)


# ---------------------------------------------------------------------------------------------
# can_admit
# ---------------------------------------------------------------------------------------------


def test_can_admit_is_false_without_a_free_slot():
    scheduler = make_scheduler(max_batch_size=2, n_pages=40)
    scheduler.add([make_seq(5), make_seq(5)])
    assert len(admit(scheduler)) == 2
    newcomer = make_seq(1)
    free_pages = scheduler.page_tables[FULL].num_free_pages
    assert free_pages > 0, f"{free_pages=}: the pool has room, only the slots are taken"
    assert not scheduler.can_admit(newcomer), f"{scheduler.slots.num_free=}"
    scheduler.add([newcomer])
    assert admit(scheduler) == [], "admit took a sequence without a free slot"


@pytest.mark.parametrize("short_regime", [FULL, SLIDING])
def test_can_admit_is_false_when_any_pool_lacks_pages(short_regime):
    # the short pool has a single usable page; the other has plenty
    scheduler = make_scheduler(max_batch_size=2, n_pages=20, windows=FULL_AND_SLIDING, pool_sizes={short_regime: 2})
    two_pages = make_seq(20)  # inside the window, so it needs 2 pages in both pools
    assert not scheduler.can_admit(two_pages), f"{short_regime} pool has 1 free page, the sequence needs 2"
    scheduler.add([two_pages])
    assert admit(scheduler) == [], f"admit took a sequence the {short_regime} pool cannot hold"


def test_can_admit_is_true_with_a_free_slot_and_room_in_every_pool():
    scheduler = make_scheduler(max_batch_size=2, windows=FULL_AND_SLIDING, pool_sizes={FULL: 3, SLIDING: 3})
    seq = make_seq(32)  # exactly the 2 usable pages of each pool
    assert scheduler.can_admit(seq), f"{seq.seq_len=} should fit 2 free pages per pool"
    scheduler.add([seq])
    assert admit(scheduler) == [seq]
    assert not scheduler.can_admit(make_seq(1)), "a slot is free, but no pool has a page left"


# ---------------------------------------------------------------------------------------------
# reserve_or_preempt, pages_fit / holds_until
# ---------------------------------------------------------------------------------------------


def test_reserve_or_preempt_preempts_the_newest_to_the_front_of_waiting_when_the_pool_runs_dry():
    scheduler = make_scheduler(max_batch_size=3, n_pages=7)  # 6 usable pages
    a, b, c, d = (make_seq(16) for _ in range(4))
    scheduler.add([a, b, c, d])
    admitted = admit(scheduler)
    assert admitted == [a, b, c], f"{len(admitted)=}"
    for seq in admitted:
        grow(seq)  # the prefill's token: seq_len 17 needs a second page
    scheduler.run(admitted)
    scheduler.reserve_or_preempt()
    check_pools(scheduler)
    assert scheduler.running == [a, b, c], f"{[s.seq_len for s in scheduler.running]=}"
    full = scheduler.page_tables[FULL]
    assert full.num_free_pages == 0, f"{full.num_free_pages=}"

    # seq_len 33: each needs a third page; the newest (c) gives its two back, a and b take them
    for seq in (a, b, c):
        grow(seq, 16)
    before = {seq.batch_idx: list(full.pages_of[seq.batch_idx]) for seq in (a, b)}
    c_slot = c.batch_idx
    scheduler.reserve_or_preempt()
    check_pools(scheduler)
    check_slots(scheduler, 3)
    assert scheduler.running == [a, b], f"{[s.batch_idx for s in scheduler.running]=}"
    assert list(scheduler.waiting) == [c, d], f"{[s.seq_len for s in scheduler.waiting]=}"
    assert (c.num_preemptions, a.num_preemptions, b.num_preemptions) == (1, 0, 0)
    assert c.batch_idx == -1 and c_slot not in scheduler.holders, f"{c.batch_idx=} {c_slot=}"
    assert c_slot in scheduler.slots.free_slots, f"{c_slot=} {list(scheduler.slots.free_slots)=}"
    assert full.pages_of[c_slot] == [], f"{full.pages_of[c_slot]=}"
    for seq in (a, b):
        pages = full.pages_of[seq.batch_idx]
        assert pages[:2] == before[seq.batch_idx], f"pages moved: {pages=} {before[seq.batch_idx]=}"
        assert len(pages) == 3 and scheduler.pages_fit(seq, seq.seq_len - 1), f"{seq.seq_len=} {pages=}"
        check_covers(scheduler, seq, seq.seq_len - 1)

    # seq_len 49: a needs a fourth page; b, now the newest, goes back in front of c
    for seq in (a, b):
        grow(seq, 16)
    scheduler.reserve_or_preempt()
    check_pools(scheduler)
    assert scheduler.running == [a], f"{len(scheduler.running)=}"
    assert list(scheduler.waiting) == [b, c, d], f"{[s.num_preemptions for s in scheduler.waiting]=}"
    assert (a.num_preemptions, b.num_preemptions) == (0, 1)
    assert full.num_pages_of(a.batch_idx) == 4, f"{full.pages_of[a.batch_idx]=}"
    check_covers(scheduler, a, a.seq_len - 1)
    assert full.num_free_pages == 2, f"{full.num_free_pages=}"


def test_reserve_or_preempt_preempts_the_sequence_itself_when_it_is_the_newest():
    scheduler = make_scheduler(max_batch_size=2, n_pages=4)  # 3 usable pages
    old, new = make_seq(10), make_seq(16)
    scheduler.add([old, new])
    assert admit(scheduler) == [old, new]
    scheduler.run([old, new])
    grow(old)
    grow(new, 17)  # seq_len 33 needs 3 pages; old holds 1 of 3
    scheduler.reserve_or_preempt()
    check_pools(scheduler)
    assert scheduler.running == [old] and list(scheduler.waiting) == [new], f"{scheduler.running=}"
    assert new.num_preemptions == 1 and new.batch_idx == -1, f"{new.num_preemptions=} {new.batch_idx=}"
    free = scheduler.page_tables[FULL].num_free_pages
    assert free == 2, f"{free=}"


def test_pages_fit_skips_the_reserve_inside_the_pages_and_reserves_across_a_page_boundary():
    """While a sequence waits (no page is taken ahead), a page is reserved exactly at a boundary."""
    scheduler = make_scheduler(max_batch_size=1, n_pages=10)
    seq = make_seq(10)
    scheduler.add([seq])
    admit(scheduler)
    scheduler.add([make_seq(1)])  # waits for the one slot
    slot, full = seq.batch_idx, scheduler.page_tables[FULL]
    assert scheduler.holds_until[slot] == PAGE_SIZE, f"{scheduler.holds_until[slot]=}"
    fits = [pos for pos in range(10, 40) if scheduler.pages_fit(seq, pos)]
    assert fits == list(range(10, 16)), f"{fits=}"

    holds = []
    hold = scheduler.hold
    scheduler.hold = lambda s, query_pos, ahead_pos=0: (holds.append(query_pos), hold(s, query_pos, ahead_pos))
    grow(seq)
    scheduler.run([seq])
    pages = list(full.pages_of[slot])
    while seq.seq_len < PAGE_SIZE:  # the next step writes position seq_len - 1 <= 15: inside page 0
        scheduler.reserve_or_preempt()
        assert holds == [], f"{seq.seq_len=}: reserved at {holds=}"
        grow(seq)
    scheduler.reserve_or_preempt()  # seq_len 16 writes position 15: still inside
    assert holds == [] and full.pages_of[slot] == pages, f"{holds=} {full.pages_of[slot]=} {pages=}"

    grow(seq)  # seq_len 17 writes position 16: page 1
    scheduler.reserve_or_preempt()
    assert holds == [PAGE_SIZE], f"{holds=}"
    assert full.pages_of[slot][:1] == pages and len(full.pages_of[slot]) == 2, f"{full.pages_of[slot]=}"
    assert scheduler.holds_until[slot] == 2 * PAGE_SIZE, f"{scheduler.holds_until[slot]=}"
    assert scheduler.pages_fit(seq, 2 * PAGE_SIZE - 1) and not scheduler.pages_fit(seq, 2 * PAGE_SIZE)
    check_pools(scheduler)


# ---------------------------------------------------------------------------------------------
# sliding window
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("regime, window", [(FULL, None), (SLIDING, WINDOW)])
def test_first_needed_pos_is_the_first_key_hf_lets_a_query_see(regime, window):
    scheduler = make_scheduler(windows=FULL_AND_SLIDING)
    for query_pos in range(100):
        # HF's sliding mask: kv_idx > q_idx - window (and causal: kv_idx <= q_idx)
        want = min(kv for kv in range(query_pos + 1) if window is None or kv > query_pos - window)
        got = scheduler.first_needed_pos(regime, query_pos)
        assert got == want, f"{regime} {query_pos=}: {got=} {want=}"


@pytest.mark.parametrize("someone_waits", [True, False], ids=["a_sequence_waits", "nobody_waits"])
def test_sliding_pool_holds_only_the_window_while_the_full_pool_holds_every_token(someone_waits):
    """The full pool holds every token (and, with nobody waiting, at most one page ahead); the
    sliding pool the window's blocks and the ones the window left since the last new page (recycled
    at the next; one, or two with a page ahead), within pool_pages' ceil(window / page) + 2 a sequence."""
    max_batch_size, max_seq_length = 2, 256
    scheduler = make_scheduler(max_batch_size, max_seq_length, n_pages=40, windows=FULL_AND_SLIDING)
    full, sliding = scheduler.page_tables[FULL], scheduler.page_tables[SLIDING]
    assert sliding.n_pages < full.n_pages, f"{sliding.n_pages=} {full.n_pages=}"
    seqs = [make_seq(5), make_seq(40)]
    scheduler.add(seqs)
    assert admit(scheduler) == seqs
    if someone_waits:
        scheduler.add([make_seq(1)])  # no slot for it
    for seq in seqs:
        check_covers(scheduler, seq, seq.seq_len)
        grow(seq)
    scheduler.run(seqs)
    ahead = 0 if someone_waits else PAGE_SIZE - 1  # positions reserved past the next one, at most
    bound = ceil_div(WINDOW, PAGE_SIZE) + 1 + (not someone_waits)
    most_held = 0
    while seqs[1].seq_len < 250:
        scheduler.reserve_or_preempt()
        check_pools(scheduler)
        assert scheduler.running == seqs, f"a sequence was preempted at {[s.seq_len for s in seqs]}"
        for seq in seqs:
            query_pos = seq.seq_len - 1
            got_full = full.num_pages_of(seq.batch_idx)
            least, most = ceil_div(seq.seq_len, PAGE_SIZE), ceil_div(seq.seq_len + ahead + 1, PAGE_SIZE)
            assert least <= got_full <= most, f"{seq.seq_len=}: {got_full=} {least=} {most=}"
            if not someone_waits:  # room for a page_size of chained steps
                assert scheduler.pages_fit(seq, min(query_pos + PAGE_SIZE, max_seq_length - 1)), f"{seq.seq_len=}"
            held = sliding.num_pages_of(seq.batch_idx)
            assert held <= bound, f"{seq.seq_len=}: sliding holds {held} pages > {bound}"
            most_held = max(most_held, held)
            # the window's blocks, and at most one it left behind since the last new page
            first_block = scheduler.first_needed_pos(SLIDING, query_pos) // PAGE_SIZE
            got_blocks = stored_blocks(sliding, seq.batch_idx)
            assert got_blocks == list(range(got_blocks[0], got_blocks[-1] + 1)), f"{seq.seq_len=}: {got_blocks=}"
            stale = 1 if someone_waits else 2
            assert first_block - stale <= got_blocks[0] <= first_block, f"{seq.seq_len=}: {got_blocks=} {first_block=}"
            assert got_blocks[-1] + 1 == full.num_pages_of(seq.batch_idx), f"{seq.seq_len=}: {got_blocks=}"
            grow(seq)
    assert most_held == bound, f"{most_held=} {bound=}"
    assert bound <= ceil_div(WINDOW, PAGE_SIZE) + 2, "beyond what pool_pages gives a sequence"


# ---------------------------------------------------------------------------------------------
# retire, can_chain, abort
# ---------------------------------------------------------------------------------------------


def test_retire_releases_finished_sequences_and_keeps_the_others_in_order():
    scheduler = make_scheduler(max_batch_size=4, n_pages=20, windows=FULL_AND_SLIDING)
    seqs = [make_seq(n) for n in (5, 20, 40, 7)]
    scheduler.add(seqs)
    assert admit(scheduler) == seqs
    for seq in seqs:
        grow(seq)
    scheduler.run(seqs)
    scheduler.reserve_or_preempt()
    done = seqs[1]
    done.finished = True
    done_slot = done.batch_idx
    kept_pages = {seq.batch_idx: pages_owned(scheduler, seq) for seq in seqs if seq is not done}
    free_before = {regime: table.num_free_pages for regime, table in scheduler.page_tables.items()}
    freed = {regime: table.num_pages_of(done_slot) for regime, table in scheduler.page_tables.items()}
    scheduler.retire()
    check_pools(scheduler)
    check_slots(scheduler, 4)
    want_running = [seqs[0], seqs[2], seqs[3]]
    assert scheduler.running == want_running, f"{[s.seq_len for s in scheduler.running]=}"
    assert done.batch_idx == -1 and done_slot not in scheduler.holders, f"{done.batch_idx=} {done_slot=}"
    assert list(scheduler.slots.free_slots) == [done_slot], f"{list(scheduler.slots.free_slots)=} {done_slot=}"
    for regime, table in scheduler.page_tables.items():
        got, want = table.num_free_pages, free_before[regime] + freed[regime]
        assert freed[regime] > 0 and got == want, f"{regime}: {got=} {want=}"
        assert table.pages_of[done_slot] == [], f"{regime}: {table.pages_of[done_slot]=}"
    for seq in want_running:
        assert pages_owned(scheduler, seq) == kept_pages[seq.batch_idx], f"{seq.seq_len=}: pages changed"

    for seq in want_running:
        seq.finished = True
    scheduler.retire()
    assert scheduler.running == [] and scheduler.is_done, f"{scheduler.running=}"
    all_free(scheduler, 4)


def chain_setup(max_batch_size=2, n_pages=5, max_seq_length=64):
    """One running sequence, mid-page, just after reserve_or_preempt; 3 of 4 usable pages free."""
    scheduler = make_scheduler(max_batch_size, max_seq_length, n_pages)
    seq = make_seq(10)
    scheduler.add([seq])
    admit(scheduler)
    grow(seq)
    scheduler.run([seq])
    scheduler.reserve_or_preempt()
    return scheduler, seq


def grow_to(scheduler: Scheduler, seq: Sequence, seq_len: int) -> None:
    grow(seq, seq_len - seq.seq_len)
    scheduler.reserve_or_preempt()


def add_running(scheduler: Scheduler, seq: Sequence) -> None:
    scheduler.add([seq])
    assert admit(scheduler) == [seq]
    grow(seq)
    scheduler.run([seq])
    scheduler.reserve_or_preempt()


def finish_another_running(scheduler: Scheduler, seq: Sequence) -> None:
    other = make_seq(5)
    add_running(scheduler, other)
    other.finished = True


def fill_the_slots_then_wait(scheduler: Scheduler, seq: Sequence) -> None:
    add_running(scheduler, make_seq(5))
    scheduler.add([make_seq(1)])


def cross_a_page_boundary_while_a_sequence_waits(scheduler: Scheduler, seq: Sequence) -> None:
    fill_the_slots_then_wait(scheduler, seq)  # nobody waiting would have taken the next page ahead
    grow_to(scheduler, seq, 2 * PAGE_SIZE)  # the end of the page it took ahead before anyone waited


def finish_another_while_a_sequence_waits(scheduler: Scheduler, seq: Sequence) -> None:
    finish_another_running(scheduler, seq)
    scheduler.add([make_seq(5)])  # it could take the finished one's slot


def cross_a_page_boundary_with_the_pool_full(scheduler: Scheduler, seq: Sequence) -> None:
    add_running(scheduler, make_seq(20))  # takes the 2 pages seq's page ahead left free
    grow_to(scheduler, seq, 2 * PAGE_SIZE)


CHAIN_BREAKERS = {
    "finished": lambda sch, seq: setattr(seq, "finished", True),
    "next_position_crosses_a_page_boundary_while_a_sequence_waits": cross_a_page_boundary_while_a_sequence_waits,
    "next_position_crosses_a_page_boundary_with_the_pool_full": cross_a_page_boundary_with_the_pool_full,
    "a_waiting_sequence_could_start": lambda sch, seq: sch.add([make_seq(5)]),
    "another_finished_while_a_sequence_waits": finish_another_while_a_sequence_waits,
}

CHAIN_KEEPERS = {
    "mid_page": lambda sch, seq: None,
    "two_new_tokens_left": lambda sch, seq: setattr(seq, "max_new_tokens", len(seq.output_ids) + 2),
    # its last token: the chained step writes its K/V at seq_len (inside its pages) and its token is dropped
    "current_token_is_the_last_new_one": lambda sch, seq: setattr(seq, "max_new_tokens", len(seq.output_ids) + 1),
    "current_token_reaches_max_seq_length": lambda sch, seq: grow_to(sch, seq, 63),
    "one_below_max_seq_length": lambda sch, seq: grow_to(sch, seq, 62),
    "next_position_is_the_last_of_its_page": lambda sch, seq: grow_to(sch, seq, 15),
    "next_position_crosses_a_page_boundary_a_page_taken_ahead": lambda sch, seq: grow_to(sch, seq, 16),
    "another_running_sequence_finished_and_rides_along": finish_another_running,
    "waiting_sequence_lacks_pages": lambda sch, seq: sch.add([make_seq(60)]),
    "waiting_sequence_lacks_a_slot": fill_the_slots_then_wait,
}


@pytest.mark.parametrize("case", list(CHAIN_BREAKERS))
def test_can_chain_is_false_when_the_batch_would_change(case):
    scheduler, seq = chain_setup()
    assert scheduler.can_chain(), f"setup: {seq.seq_len=}"
    CHAIN_BREAKERS[case](scheduler, seq)
    assert not scheduler.can_chain(), f"{case}: {seq.seq_len=} {seq.max_new_tokens=} {len(seq.output_ids)=}"


@pytest.mark.parametrize("case", list(CHAIN_KEEPERS))
def test_can_chain_is_true_when_the_same_batch_goes_on(case):
    scheduler, seq = chain_setup()
    CHAIN_KEEPERS[case](scheduler, seq)
    assert scheduler.running[0] is seq and not seq.finished, f"{case}: {scheduler.running=}"
    assert scheduler.can_chain(), f"{case}: {seq.seq_len=} {seq.max_new_tokens=} {len(scheduler.waiting)=}"


def test_can_chain_ends_when_fewer_rows_are_live_than_the_caller_needs():
    """The finished ride along only while the live rows still need the batch's bucket."""
    scheduler, seq = chain_setup(max_batch_size=3, n_pages=8)
    finish_another_running(scheduler, seq)
    assert scheduler.can_chain(min_live=1) and not scheduler.can_chain(min_live=2)


def test_abort_gives_back_every_slot_and_page_including_admitted_but_not_run():
    max_batch_size = 3
    scheduler = make_scheduler(max_batch_size, n_pages=20, windows=FULL_AND_SLIDING)
    seqs = [make_seq(n) for n in (30, 50, 12, 9)]
    scheduler.add(seqs)
    admitted = admit(scheduler)
    assert admitted == seqs[:3]
    running, pending = admitted[:2], admitted[2]
    for seq in running:
        grow(seq, 20)
    scheduler.run(running)
    scheduler.reserve_or_preempt()
    assert pending not in scheduler.running and pending.batch_idx in scheduler.holders, f"{pending.batch_idx=}"
    assert list(scheduler.waiting) == [seqs[3]]
    for regime, table in scheduler.page_tables.items():
        assert table.num_pages_of(pending.batch_idx) > 0, f"{regime}: the admitted sequence holds no page"
    scheduler.abort()
    assert not scheduler.running and not scheduler.waiting, f"{scheduler.running=} {scheduler.waiting=}"
    batch_idxs = [s.batch_idx for s in seqs]
    assert batch_idxs == [-1] * 4, f"{batch_idxs=}"
    all_free(scheduler, max_batch_size)
    check_pools(scheduler)
    assert scheduler.is_done


# ---------------------------------------------------------------------------------------------
# randomized: the engine's loop with random lengths
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("windows", [FULL_ONLY, FULL_AND_SLIDING], ids=["full", "full_and_sliding"])
def test_random_admit_grow_preempt_retire_keeps_every_invariant(windows):
    rng = random.Random(1234)
    max_batch_size, max_seq_length, end_id = 4, 128, 2
    scheduler = make_scheduler(max_batch_size, max_seq_length, n_pages=12, windows=windows)
    pending = [make_seq(rng.randint(1, 60), max_new_tokens=rng.randint(1, 70)) for _ in range(40)]
    everyone = list(pending)

    for seq in everyone:
        seq.end_ids = frozenset({end_id})

    def step(sequences: list[Sequence]) -> None:  # a step's tokens, a rare end id among them
        scheduler.postprocess(sequences, [end_id if rng.random() < 0.02 else 5 for _ in sequences], None)

    def check(where: str, after_reserve: bool = False) -> None:
        check_pools(scheduler)
        check_slots(scheduler, max_batch_size)
        held = list(scheduler.holders.values())
        for seq in scheduler.running:
            assert any(seq is h for h in held), f"{where}: a running sequence holds no slot"
            if after_reserve:
                check_covers(scheduler, seq, seq.seq_len - 1)
                assert scheduler.pages_fit(seq, seq.seq_len - 1), f"{where}: {seq.seq_len=}"
        for seq in scheduler.waiting:
            assert seq.batch_idx == -1 and not seq.finished, f"{where}: waiting {seq.batch_idx=} {seq.finished=}"
            assert not any(seq is r for r in scheduler.running), f"{where}: waiting and running"

    steps = 0
    while pending or not scheduler.is_done:
        steps += 1
        assert steps < 3000, "the loop does not finish"
        if pending and rng.random() < 0.3:
            k = rng.randint(1, 4)
            scheduler.add(pending[:k])
            del pending[:k]
        admitted = admit(scheduler, rng.choice([None, 64, 128]))
        for seq in admitted:
            check_covers(scheduler, seq, seq.seq_len)
        step(admitted)  # the prefill's tokens
        scheduler.run(admitted)
        check("admit")
        scheduler.retire()
        check("retire")
        scheduler.reserve_or_preempt()
        check("reserve_or_preempt", after_reserve=True)
        assert all(not s.finished for s in scheduler.running), "a finished sequence still runs"
        step(scheduler.running)  # one decode step
        if rng.random() < 0.5:
            scheduler.retire()
            check("retire after decode")
    assert steps >= 200, f"{steps=}: too few steps to mean much"
    num_preemptions = sum(s.num_preemptions for s in everyone)
    assert num_preemptions > 0, f"{num_preemptions=}: the pool never ran dry"
    for seq in everyone:
        assert seq.finished and seq.batch_idx == -1, f"{seq.finished=} {seq.batch_idx=}"
        assert len(seq.output_ids) <= seq.max_new_tokens and seq.seq_len <= max_seq_length, f"{seq.seq_len=}"
        is_stopped = seq.output_ids[-1] == end_id
        assert seq.finish_reason == ("stop" if is_stopped else "length"), f"{seq.finish_reason=} {seq.output_ids[-3:]=}"
    assert {seq.finish_reason for seq in everyone} == {"stop", "length"}, "the run never ended both ways"
    all_free(scheduler, max_batch_size)


# ---------------------------------------------------------------------------------------------
# postprocess: tokens out, and the one length rule
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt_len, max_new_tokens, tokens, want_len, want_reason",
    [
        (10, 5, [5, 6, 7, 8, 9, 4], 5, "length"),  # max_new_tokens
        (10, 5, [5, 2, 7], 2, "stop"),  # an end id is kept and finishes it
        (10, 5, [5, 6, 7, 8, 2], 5, "stop"),  # an end id at the limit says stop
        (120, 50, [5] * 20, 8, "length"),  # max_seq_length (128) in all
        (127, 50, [5, 6], 1, "length"),  # one token from max_seq_length: the prefill's finishes it
    ],
)
def test_postprocess_finishes_a_sequence_at_an_end_id_or_its_length_limit(
    prompt_len, max_new_tokens, tokens, want_len, want_reason
):
    scheduler = make_scheduler(max_seq_length=128)
    seq = make_seq(prompt_len, max_new_tokens)
    seq.end_ids = frozenset({2})
    for token in tokens:
        assert scheduler.postprocess([seq], [token], None) == 1
        if seq.finished:
            break
    assert (len(seq.output_ids), seq.finish_reason) == (want_len, want_reason), (
        f"{seq.output_ids=} {seq.finish_reason=}"
    )
    assert scheduler.postprocess([seq], [5], None) == 0 and len(seq.output_ids) == want_len, (
        "a finished row took a token"
    )


def test_postprocess_records_log_probs_and_logits_only_for_sequences_that_ask():
    from qwen3_flex_inference import SamplingParams

    scheduler = make_scheduler()
    plain, with_logprobs, with_logits = make_seq(4), make_seq(4), make_seq(4)
    with_logprobs.sampling = SamplingParams(logprobs=0)
    with_logits.record_logits = True
    logits_NV = torch.arange(12.0).reshape(3, 4)
    num_taken = scheduler.postprocess([plain, with_logprobs, with_logits], [7, 8, 9], [-0.5, -1.5, -2.5], logits_NV)
    assert num_taken == 3 and [s.output_ids for s in (plain, with_logprobs, with_logits)] == [[7], [8], [9]]
    assert (plain.output_logprobs, with_logprobs.output_logprobs, with_logits.output_logprobs) == ([], [-1.5], [])
    assert not plain.output_logits and torch.equal(with_logits.output_logits[0], logits_NV[2])


@pytest.mark.parametrize("seed", range(3))
def test_chained_steps_write_only_inside_each_sequences_pages_and_the_length_limit(seed):
    """Decoding to the end with every chain can_chain allows (the finished riding along until the
    chain ends): each live row's chained write (at its seq_len) lies inside its pages and below
    max_seq_length; each sequence ends by the length rule postprocess applies; with nobody waiting,
    a page taken ahead lets most steps chain."""
    rng = random.Random(seed)
    max_seq_length = 64
    scheduler = make_scheduler(max_batch_size=3, max_seq_length=max_seq_length, n_pages=16)
    seqs = [make_seq(rng.randint(1, 30), rng.randint(1, 30)) for _ in range(3)]
    scheduler.add(seqs)
    scheduler.run(admit(scheduler))
    assert not scheduler.waiting and len(scheduler.running) == 3
    num_steps = num_chained = 0
    while scheduler.running:
        scheduler.reserve_or_preempt()
        while True:
            is_chained = scheduler.can_chain()
            for seq in scheduler.running:
                if is_chained and not seq.finished:
                    assert scheduler.pages_fit(seq, seq.seq_len) and seq.seq_len < max_seq_length, f"{seq.seq_len=}"
            scheduler.postprocess(scheduler.running, [5] * len(scheduler.running), None)
            num_steps += 1
            if not is_chained:
                break
            num_chained += 1
        scheduler.retire()
    for seq in seqs:
        assert seq.finish_reason == "length" and scheduler.is_at_length_limit(seq), f"{seq.seq_len=}"
        assert len(seq.output_ids) == min(seq.max_new_tokens, max_seq_length - (seq.seq_len - len(seq.output_ids)))
    assert num_chained >= num_steps - 8, f"{num_chained=} of {num_steps=}"


def test_batch_slots_never_hand_out_slot_zero():
    slots = BatchSlots(4)
    got = [slots.allocate() for _ in range(3)]
    assert sorted(got) == [1, 2, 3] and not slots.can_allocate(), f"{got=}"


def make_group(num_tokens: int, n: int) -> list[Sequence]:
    """n completions of one prompt, as rollouts makes them: the first is prefilled for all."""
    group = [make_seq(num_tokens) for _ in range(n)]
    for seq in group[1:]:
        seq.shares_prompt_with = group[0]
    return group


def test_forks_share_the_full_prompt_pages_and_each_holds_its_partial_page():
    scheduler = make_scheduler(max_batch_size=4, n_pages=20)
    table = scheduler.page_tables["full_attention"]
    group = make_group(37, 3)  # 2 full pages of 16 and a partial one
    scheduler.add(group)
    admitted, forks = scheduler.admit()
    assert admitted == [group[0]] and [(f, s) for f, s in forks] == [(group[1], group[0]), (group[2], group[0])]
    pages = [table.pages_of[seq.batch_idx] for seq in group]
    assert pages[1][:2] == pages[2][:2] == pages[0][:2], f"{pages=}"
    assert len({p[2] for p in pages}) == 3, f"the partial pages are shared: {pages=}"
    assert table.num_used_pages == 3 + 1 + 1, f"{table.num_used_pages=} (separate prompts would hold 9)"
    assert [table.num_holders[page] for page in pages[0]] == [3, 3, 1]


def test_a_released_sharer_leaves_the_others_pages_and_the_last_one_frees_them():
    scheduler = make_scheduler(max_batch_size=4, n_pages=20)
    table = scheduler.page_tables["full_attention"]
    group = make_group(40, 3)
    scheduler.add(group)
    scheduler.run([seq for seq in admit_all(scheduler)])
    leader_pages = list(table.pages_of[group[0].batch_idx])
    fork_rows = {seq.batch_idx: table.logical_to_physical_cpu[seq.batch_idx].clone() for seq in group[1:]}
    scheduler.release(group[0])  # e.g. preempted
    for seq in group[1:]:
        assert torch.equal(table.logical_to_physical_cpu[seq.batch_idx], fork_rows[seq.batch_idx])
    assert not set(leader_pages[:2]) & set(table.free_pages), "a page still shared went back to the pool"
    assert leader_pages[2] in table.free_pages, "the leader's own partial page was not freed"
    for seq in group[1:]:
        scheduler.release(seq)
    assert table.num_free_pages == table.n_pages - 1 and table.num_used_pages == 0


def test_a_follower_whose_source_already_decoded_is_prefilled_on_its_own():
    scheduler = make_scheduler(max_batch_size=1, n_pages=20)  # one slot: the follower waits
    group = make_group(20, 2)
    scheduler.add(group)
    assert admit_all(scheduler) == [group[0]]
    grow(group[0])
    group[0].finished = True
    scheduler.run([group[0]])
    scheduler.retire()
    admitted, forks = scheduler.admit()
    assert admitted == [group[1]] and forks == [], f"{admitted=} {forks=}"


def admit_all(scheduler) -> list[Sequence]:
    """The admitted sequences and the forks, in admission order."""
    admitted, forks = scheduler.admit()
    return admitted + [fork for fork, _ in forks]
