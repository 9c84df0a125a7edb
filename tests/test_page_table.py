"""Page-table bookkeeping: free + used = total through allocate / reserve / erase / preempt."""

import random

import pytest
import torch

from qwen3_flex_inference import BatchSlots, PageTable, check_engine_limits


def check_invariants(table: PageTable):
    total = table.n_pages - 1  # page 0 is reserved
    assert table.num_free_pages + table.num_used_pages == total, (
        f"{table.num_free_pages=} {table.num_used_pages=} {total=}"
    )
    owned = [p for pages in table.pages_of for p in pages]
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert 0 not in owned and 0 not in table.free_pages, "the reserved page 0 was handed out"
    assert not set(owned) & set(table.free_pages), "a page is both free and owned"
    for batch_idx, pages in enumerate(table.pages_of):
        assert table.capacity[batch_idx] == len(pages) * table.page_size
        for logical_block_idx, physical_page_idx in enumerate(pages):
            assert table.logical_to_physical_cpu[batch_idx, logical_block_idx] == physical_page_idx
            assert table.physical_to_logical_cpu[batch_idx, physical_page_idx] == logical_block_idx
    assert (table.physical_to_logical_cpu >= 0).sum() == len(owned) + 1  # + slot 0 owning page 0


def test_page_table_invariants_hold_through_random_allocate_reserve_erase():
    table = PageTable(page_size=16, n_pages=40, num_slots=6, max_seq_length=256, device="cpu")
    slots = BatchSlots(num_slots=6)
    rng = random.Random(0)
    live: dict[int, int] = {}
    for _ in range(500):
        action = rng.random()
        if action < 0.3 and slots.can_allocate():
            batch_idx = slots.allocate()
            assert batch_idx != 0, "slot 0 is reserved for padding rows"
            live[batch_idx] = 0
        elif action < 0.8 and live:
            batch_idx = rng.choice(list(live))
            seq_len = min(live[batch_idx] + rng.randint(1, 40), 256)
            if table.can_reserve(seq_len, batch_idx):
                table.reserve(batch_idx, seq_len)
                live[batch_idx] = seq_len
                assert table.capacity[batch_idx] >= seq_len
            else:
                with pytest.raises(RuntimeError):
                    table.reserve(batch_idx, seq_len)
        elif live:  # erase (finish or preempt)
            batch_idx = rng.choice(list(live))
            table.erase(batch_idx)
            slots.free(batch_idx)
            del live[batch_idx]
        check_invariants(table)
    table.flush()
    assert torch.equal(table.logical_to_physical.cpu(), table.logical_to_physical_cpu)
    assert torch.equal(table.physical_to_logical.cpu(), table.physical_to_logical_cpu)


def test_physical_slots_follow_the_page_table():
    table = PageTable(page_size=16, n_pages=10, num_slots=3, max_seq_length=64, device="cpu")
    a, b = 1, 2
    table.reserve(a, 20)
    table.reserve(b, 40)
    table.reserve(a, 33)
    slots = table.physical_slots(a, 0, 33)
    pages = table.pages_of[a]
    assert slots == [pages[i // 16] * 16 + i % 16 for i in range(33)]
    assert len(set(slots) & set(table.physical_slots(b, 0, 40))) == 0


@pytest.mark.parametrize(
    "limits, message",
    [
        ((4, 100, 64, 16, 8), "multiple of page_size"),
        ((4, 128, 4, 16, 8), "cannot hold even one sequence"),
        ((4, 128, 64, 16, 0), "max_new_tokens"),
        ((4, 128, 64, 12, 8), "power of two"),
    ],
)
def test_engine_limits_reject_bad_sizes_with_one_sentence(limits, message):
    with pytest.raises(ValueError, match=message):
        check_engine_limits(*limits)


def test_trimmed_blocks_recycle_their_pages_and_map_to_the_reserved_page():
    table = PageTable(page_size=16, n_pages=8, num_slots=3, max_seq_length=256, device="cpu")
    a = 1
    table.reserve(a, 40, first_needed_pos=20)  # block 0 (positions 0-15) is never stored
    assert table.pages_of[a][0] is None and table.num_pages_of(a) == 2
    assert table.physical_slots(a, 0, 16) == [0] * 16
    table.trim(a, 40)  # blocks 0-1 out of the window
    assert table.num_pages_of(a) == 1 and table.num_free_pages == 6
    assert table.logical_to_physical_cpu[a, 1] == 0 and (table.physical_to_logical_cpu[a] >= 0).sum() == 1
    # 7 usable pages, 6 free: growing to 146 tokens needs 7 new blocks (3-9), so block 2 must recycle
    assert table.can_reserve(146, a, first_needed_pos=48) and not table.can_reserve(146, a, first_needed_pos=0)
    table.trim(a, 48)
    table.reserve(a, 146, first_needed_pos=48)
    assert table.num_pages_of(a) == 7 and table.num_free_pages == 0
    table.erase(a)
    assert table.num_free_pages == 7 and table.num_used_pages == 0


@pytest.mark.parametrize("sliding_window", [None, 40, 16])
def test_visible_logical_blocks_are_exactly_the_blocks_the_causal_mask_touches(sliding_window):
    """Decode rows list every logical block their query sees, windowed or not, and no other."""
    from torch.nn.attention.flex_attention import create_block_mask

    from qwen3_flex_inference import causal_mask_mod, visible_logical_blocks

    page_size, max_seq_length = 16, 128
    logical = create_block_mask(
        causal_mask_mod(sliding_window), None, None, max_seq_length, max_seq_length, device="cpu", BLOCK_SIZE=page_size
    )
    dense = logical.to_dense()[0, 0]  # [q blocks, kv blocks]: 1 where a block is partly or fully visible
    input_pos_B = torch.tensor([0, 15, 16, 39, 40, 57, 100, 127])
    kv_num_blocks, kv_indices = visible_logical_blocks(
        input_pos_B, page_size, sliding_window, max_seq_length // page_size
    )
    for b, pos in enumerate(input_pos_B.tolist()):
        got = kv_indices[b, 0, 0, : kv_num_blocks[b, 0, 0]].tolist()
        # the blocks holding a position the query at `pos` sees (its own block row may touch later ones)
        want = sorted({kv // page_size for kv in range(pos + 1) if sliding_window is None or pos - kv < sliding_window})
        assert got == want, f"{pos=} {got=} {want=}"
        assert set(want) <= set(dense[pos // page_size].nonzero().flatten().tolist())
