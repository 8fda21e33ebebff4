"""The timing records' ``details``: figures a component inside the model adds to the
micro-batch whose forward is running (``TimingRecorder.add_detail``; the image-level vision
exchange splits its forward with them). Pure: no process group."""
import json

from megatron_mm_balance.megatron.timing import TimingRecorder


def test_details_are_summed_into_the_running_micro_batchs_record(tmp_path):
    rec = TimingRecorder(rank=3, out_dir=str(tmp_path))
    rec.add_detail("vision_tower_ms", 9.0)              # no forward running: nowhere to go
    first = rec.begin([64], [100])
    rec.add_detail("vision_tower_ms", 2.5)
    rec.add_detail("vision_tower_ms", 1.5)
    rec.add_detail("vision_tower_calls", 1)
    rec.backward_started(first)
    second = rec.begin([], [100])                        # closes the first record
    rec.backward_started(second)
    rec.skip()                                           # an evaluation forward: nothing added
    rec.add_detail("vision_gather_ms", 7.0)
    rec.close()
    lines = [json.loads(x) for x in open(rec.path, encoding="utf-8")]
    assert [x["microbatch"] for x in lines] == [0, 1]
    assert lines[0]["details"] == {"vision_tower_calls": 1.0, "vision_tower_ms": 4.0}
    assert "details" not in lines[1]
