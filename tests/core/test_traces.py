import json

import pytest

from megatron_mm_balance.data.traces import (TraceError, Sample, load_bundled, load_trace,
                                        parse_trace_text, summarize, write_trace)


def test_jsonl_roundtrip(tmp_path):
    samples = [Sample(100, (64, 32)), Sample(50, ()), Sample(8192, (8000,))]
    path = tmp_path / "t.jsonl"
    write_trace(str(path), samples)
    assert load_trace(str(path)) == samples


def test_images_optional_and_blank_lines():
    text = '{"tokens": 10}\n\n{"tokens": 20, "images": [5]}\n'
    assert parse_trace_text(text) == [Sample(10, ()), Sample(20, (5,))]


def test_omnibal_array_uses_tokens_per_tile():
    text = json.dumps([{"vit_num": 2, "token_num": 600, "image_flags": 2},
                       {"vit_num": 0, "token_num": 40}])
    assert parse_trace_text(text, tokens_per_tile=256) == [Sample(600, (256, 256)), Sample(40, ())]
    assert parse_trace_text(text, tokens_per_tile=100)[0].images == (100, 100)


@pytest.mark.parametrize("text, needle", [
    ('{"tokens": 10}\n{"tokens": ', ":2: malformed JSON"),
    ('{"tokens": -1}', "'tokens' must be >= 0"),
    ('{"tokens": 10, "images": [-3]}', "must be >= 0"),
    ('{"tokens": 10, "images": [20]}', "exceed total tokens"),
    ('{"tokens": "ten"}', "must be an integer"),
    ('{"images": [1]}', "missing 'tokens'"),
    ('[1, 2]', "expected a JSON object"),
    ('[{"vit_num": -1, "token_num": 5}]', "'vit_num'"),
    ('   ', "empty"),
])
def test_malformed_traces_name_the_problem(text, needle):
    with pytest.raises(TraceError, match=needle.replace("(", r"\(")):
        parse_trace_text(text, name="x.jsonl")


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        load_trace(str(tmp_path / "nope.jsonl"))
    with pytest.raises(TraceError, match="is a directory"):
        load_trace(str(tmp_path))


def test_bundled_traces_match_the_shared_statistics():
    ai2d, chart = load_bundled("ai2d"), load_bundled("chartqa")
    assert (len(ai2d), len(chart)) == (12413, 18317)
    assert {len(s.images) for s in ai2d} >= {1, 3, 5}
    assert min(s.text_tokens for s in ai2d + chart) >= 33
    info = summarize(chart)
    assert info["text_only_share"] == 0.0 and info["image_token_share"] > 0.5
