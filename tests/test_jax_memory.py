"""The JAX memory probe between allocator peak records (XLA has no peak reset)."""

from triaccel.backends.jax.memory import MemoryProbe


class FakeDevice:
    platform = "gpu"

    def __init__(self):
        self.stats = {"bytes_in_use": 0, "peak_bytes_in_use": 0, "bytes_limit": 10_000}

    def memory_stats(self):
        return dict(self.stats)


def test_step_peak_estimated_from_the_last_record_scaled_by_batch():
    dev = FakeDevice()
    probe = MemoryProbe(dev)
    dev.stats.update(bytes_in_use=1000, peak_bytes_in_use=5000)      # batch 100: a new record
    assert probe.read(batch=100).used == 5000
    dev.stats.update(bytes_in_use=1000)                                # batch 50: peak not seen
    assert probe.read(batch=50).used == 1000 + 4000 * 50 // 100        # 3000, not the 1000 in use
    assert probe.read(batch=200).used == 9000                          # scaled up before it happens
    dev.stats.update(bytes_in_use=1200, peak_bytes_in_use=9500)       # a new record at batch 200
    assert probe.read(batch=200).used == 9500
    assert probe.read().used == 1200                                   # no batch: bytes in use now
    assert probe.read(batch=100).limit == 10_000
