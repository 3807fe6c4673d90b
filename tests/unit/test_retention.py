"""Retention policy (a pure function) and its application to committed checkpoints on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoint.durable.discovery import Candidate, apply_retention, checkpoint_id, fresh_dir, retention_plan


def kept(plan):
    return sorted(step for step, tiers in plan.items() if tiers)


def steps(*xs):
    return [Candidate(x) for x in xs]


def test_keep_last_keeps_the_newest():
    plan = retention_plan(steps(100, 200, 300, 400), keep_last=2)
    assert kept(plan) == [300, 400]
    assert plan[400] == ["rolling"] and plan[100] == []


def test_keep_last_one_keeps_only_the_newest_committed():
    assert kept(retention_plan(steps(100, 200), keep_last=1)) == [200]
    assert kept(retention_plan(steps(100), keep_last=1)) == [100]


def test_keep_every_is_permanent():
    plan = retention_plan(steps(*range(50, 501, 50)), keep_last=2, keep_every=200)
    assert kept(plan) == [200, 400, 450, 500]
    assert plan[200] == ["permanent"]


def test_keep_best_tracks_the_lowest_metric():
    cands = [Candidate(100, 3.0), Candidate(200, 1.5), Candidate(300, 2.0), Candidate(400, 2.5),
             Candidate(500, None)]
    plan = retention_plan(cands, keep_last=1, keep_best=2)
    assert kept(plan) == [200, 300, 500]
    assert plan[200] == ["best"] and plan[500] == ["rolling"]


def test_tiers_combine_and_the_newest_is_never_deleted():
    plan = retention_plan(steps(100, 200, 300), keep_last=1, keep_every=300)
    assert plan[300] == ["rolling", "permanent"]
    for n in range(1, 6):
        for k in (1, 2, 3):
            cands = steps(*range(10, 10 * n + 1, 10))
            assert max(c.step for c in cands) in kept(retention_plan(cands, keep_last=k, keep_every=7))


def test_keep_last_zero_is_rejected():
    with pytest.raises(ValueError, match="keep_last=0 must be >= 1"):
        retention_plan(steps(1), keep_last=0)


def _fake_checkpoint(root, step, loss=None, committed=True):
    """A checkpoint of ``step`` in a fresh folder (a later save of a step goes beside the first); without a
    manifest when not committed (a save in flight)."""
    d = Path(fresh_dir(root, step))
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x")
    if committed:
        from checkpoint.durable.manifest import FileEntry, Manifest, write_manifest

        write_manifest(d, Manifest(checkpoint_id(step), step, 0, 0, 0.0, "h", {}, 1, {}, 8, loss, None, None,
                                   {"__0_0.distcp": FileEntry(1, None)}))
    return d


def test_apply_retention_deletes_only_older_committed(tmp_path):
    for s in (10, 20, 30):
        _fake_checkpoint(tmp_path, s)
    in_flight = _fake_checkpoint(tmp_path, 40, committed=False)
    deleted = apply_retention(tmp_path, keep_last=1, keep_every=0, keep_best=0, best_metric="loss")
    assert deleted == [checkpoint_id(20), checkpoint_id(10)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_id(30), in_flight.name]


def test_bad_checkpoints_do_not_count_as_kept(tmp_path):
    from checkpoint.durable.discovery import list_committed, mark_bad

    for s in (10, 20):
        _fake_checkpoint(tmp_path, s)
    mark_bad(tmp_path / checkpoint_id(20), "probe loss mismatch")
    apply_retention(tmp_path, keep_last=1, keep_every=0, keep_best=0, best_metric="loss")
    assert [c.step for c in list_committed(tmp_path)] == [10]  # the only good one survives
    assert (tmp_path / checkpoint_id(20)).is_dir()  # the bad one stays for people to inspect


def test_the_newest_verified_checkpoint_is_never_deleted():
    # 8 was saved after a guard alarm; 4 stays as permanent; 6 is what a rollback needs
    cands = [Candidate(4, verified=True), Candidate(6, verified=True), Candidate(8, verified=False)]
    plan = retention_plan(cands, keep_last=1, keep_every=4)
    assert kept(plan) == [4, 6, 8] and plan[6] == ["verified"]


def test_bad_superseded_and_replaced_directories_keep_the_newest_few(tmp_path):
    from checkpoint.durable.discovery import mark_bad, mark_superseded

    for s in (10, 20, 30, 40, 50):
        _fake_checkpoint(tmp_path, s)
    mark_bad(tmp_path / checkpoint_id(20), "flipped byte")
    mark_superseded(tmp_path, 40, "rolled back to step 40")
    _fake_checkpoint(tmp_path, 30)  # saved again, twice (a re-save goes beside, never over, what is there)
    _fake_checkpoint(tmp_path, 30)
    replaced = sorted(p.name for p in tmp_path.glob("step_00000030*"))
    assert replaced == [checkpoint_id(30), checkpoint_id(30, 1), checkpoint_id(30, 2)]
    apply_retention(tmp_path, keep_last=1, keep_every=0, keep_best=0, best_metric="loss", keep_forensic=2)
    # in the tiers: 40 (rolling, the newest verified); step 30's checkpoint (its newest save) is not in a tier;
    # forensic, newest first: 50 (superseded), then the newer of the two replaced saves of step 30; the older
    # one and the BAD 20 are reclaimed
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([checkpoint_id(40), replaced[1], checkpoint_id(50)])
    apply_retention(tmp_path, keep_last=1, keep_every=0, keep_best=0, best_metric="loss", keep_forensic=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_id(40)]


def test_a_checkpoint_of_a_newer_format_stays_committed_and_kept_but_is_not_read_for_use(tmp_path):
    """An older checkout sharing the folder must neither sweep nor load a newer trainer's checkpoint."""
    import dataclasses
    import json
    import shutil

    from checkpoint.durable.discovery import clean_uncommitted, list_committed
    from checkpoint.durable.manifest import FORMAT_VERSION, MANIFEST, NewerFormat, read_manifest, write_manifest

    for s in (10, 20, 30):
        _fake_checkpoint(tmp_path, s)
    newest = tmp_path / checkpoint_id(30)
    write_manifest(newest, dataclasses.replace(read_manifest(newest), format_version=FORMAT_VERSION + 1))
    # one a newer format changed past what this checkout parses: a field renamed, a file entry with a new key
    changed = tmp_path / checkpoint_id(20)
    raw = json.loads((changed / MANIFEST).read_text())
    raw["format_version"], raw["tokens_seen"] = FORMAT_VERSION + 1, raw.pop("tokens")
    raw["files"]["__0_0.distcp"]["compression"] = "zstd"
    (changed / MANIFEST).write_text(json.dumps(raw))
    assert clean_uncommitted(tmp_path) == [] and changed.is_dir()
    assert [c.step for c in list_committed(tmp_path)] == [30, 20, 10]
    with pytest.raises(NewerFormat):
        read_manifest(changed)
    shutil.rmtree(changed)
    assert apply_retention(tmp_path, keep_last=1, keep_every=0, keep_best=0, best_metric="loss") == [checkpoint_id(10)]
    assert [c.step for c in list_committed(tmp_path)] == [30]
    with pytest.raises(NewerFormat, match=f"manifest format {FORMAT_VERSION + 1}; this checkout reads formats up to"):
        read_manifest(newest)
