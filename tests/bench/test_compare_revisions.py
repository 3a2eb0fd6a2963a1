"""bench.compare_revisions runs both trees' measurements in fresh processes and writes medians and ratios."""

import json
from pathlib import Path

from bench import compare_revisions


def test_a_tree_against_itself_gives_ratios_near_one_and_a_results_file(tmp_path):
    out = tmp_path / "revision.json"
    repo = Path(compare_revisions.__file__).resolve().parents[1]
    assert compare_revisions.main(["--before", str(repo), "--rounds", "1", "--steps", "1", "--new-tokens", "4",
                                   "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["after_over_before_speed"]) == {"train_step_speed", "text_decode_speed", "image_decode_speed"}
    for name in ("before", "after"):
        assert all(value > 0 for value in result["medians"][name].values())
