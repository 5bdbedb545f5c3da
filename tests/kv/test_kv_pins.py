"""Pins: never evicted while alive, expiry, refresh, cap, unpin."""
import pytest

from prefixserve.kv import KVCacheConfig, KVCacheManager, PinLimitError


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make(num_blocks=8, block_size=4, **kwargs):
    clock = FakeClock()
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=block_size, **kwargs),
                          clock=clock), clock


def cache(kv, rid, tokens):
    kv.allocate_slots(rid, tokens, 0, len(tokens))
    kv.free(rid)


def fill_pool(kv, rid, num_blocks):
    return kv.allocate_slots(rid, list(range(1000, 1000 + 4 * num_blocks)), 0, 4 * num_blocks)


def test_pinned_blocks_are_never_evicted():
    kv, _ = make()
    system = list(range(12))
    cache(kv, "a", system)
    info = kv.pin_prefix(system)
    assert info.num_tokens == 12 and len(info.block_ids) == 3 and info.expires_at is None
    assert kv.stats().num_pinned_blocks == 3
    kv.check_integrity()
    assert fill_pool(kv, "big", 6) is None          # only 5 blocks are not pinned
    assert fill_pool(kv, "big", 5) is not None
    kv.check_integrity()
    assert kv.find_cached_prefix("q", system + [1]).num_tokens == 12
    kv.free("big")
    assert kv.unpin(info.pin_id) is True
    assert kv.unpin(info.pin_id) is False
    assert fill_pool(kv, "big2", 8) is not None     # now everything can be evicted
    kv.check_integrity()


def test_pins_expire_and_repinning_refreshes():
    kv, clock = make()
    system = list(range(8))
    cache(kv, "a", system)
    first = kv.pin_prefix(system, ttl_s=10)
    assert first.expires_at == 110.0
    clock.now = 105.0
    again = kv.pin_prefix(system, ttl_s=10)
    assert again.pin_id == first.pin_id and again.expires_at == 115.0
    assert len(kv.pins()) == 1
    clock.now = 112.0                                 # past the first expiry, not the refreshed
    assert fill_pool(kv, "big", 7) is None
    clock.now = 115.0
    assert kv.can_allocate(8)
    assert kv.pins() == [] and kv.stats().num_pinned_blocks == 0
    assert fill_pool(kv, "big", 8) is not None
    kv.check_integrity()


def test_pin_cap_raises_and_pins_nothing():
    kv, _ = make(max_pinned_blocks=3)
    cache(kv, "a", list(range(9)))
    cache(kv, "b", list(range(50, 59)))
    kv.pin_prefix(list(range(9)))
    # A shorter prefix of the same chain is a second pin but no new pinned block.
    kv.pin_prefix(list(range(9)), num_tokens=4)
    with pytest.raises(PinLimitError, match="max_pinned_blocks is 3"):
        kv.pin_prefix(list(range(50, 59)))
    assert kv.stats().num_pinned_blocks == 2 and len(kv.pins()) == 2
    kv.check_integrity()


def test_pin_cap_from_the_constructor():
    kv = KVCacheManager(KVCacheConfig(num_blocks=8, block_size=4), max_pinned_blocks=1)
    cache(kv, "a", list(range(9)))
    with pytest.raises(PinLimitError):
        kv.pin_prefix(list(range(9)))


def test_pin_with_nothing_cached_pins_nothing():
    kv, _ = make()
    info = kv.pin_prefix([1, 2, 3, 4, 5])
    assert info.pin_id is None and info.block_ids == [] and kv.pins() == []
    assert kv.unpin(info.pin_id) is False


def test_pin_num_tokens_limits_the_prefix():
    kv, _ = make()
    cache(kv, "a", list(range(13)))
    info = kv.pin_prefix(list(range(13)), num_tokens=9)
    assert info.num_tokens == 8


def test_pin_rejects_bad_arguments():
    kv, _ = make()
    with pytest.raises(ValueError, match="ttl_s"):
        kv.pin_prefix([1], ttl_s=0)
    with pytest.raises(ValueError, match="num_tokens"):
        kv.pin_prefix([1], num_tokens=-1)


def test_reset_drops_pins():
    kv, _ = make()
    cache(kv, "a", list(range(9)))
    kv.pin_prefix(list(range(9)))
    assert kv.reset_prefix_cache() == 2
    assert kv.pins() == [] and kv.stats().num_used_blocks == 0
    kv.check_integrity()


def test_a_pinned_block_in_use_by_a_request_needs_both_released():
    kv, _ = make()
    prompt = list(range(9))
    kv.allocate_slots("a", prompt, 0, 9)
    info = kv.pin_prefix(prompt)
    kv.check_integrity()
    kv.free("a")
    assert kv.stats().num_used_blocks == 2 and kv.stats().num_cached_free_blocks == 0
    kv.unpin(info.pin_id)
    assert kv.stats().num_cached_free_blocks == 2
    kv.check_integrity()


def test_a_shorter_repin_never_cuts_a_longer_pin_unless_asked():
    kv, clock = make()
    tokens = list(range(1, 10))
    cache(kv, "r", tokens)
    long_pin = kv.pin_prefix(tokens, ttl_s=3600.0)
    assert kv.pin_prefix(tokens, ttl_s=300.0).expires_at == long_pin.expires_at
    assert kv.pin_prefix(tokens, ttl_s=7200.0).expires_at == 100.0 + 7200.0
    assert kv.pin_prefix(tokens, ttl_s=10.0, shorten=True).expires_at == 110.0
    clock.now = 111.0
    assert kv.pins() == []
    kv.check_integrity()
