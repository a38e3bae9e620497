"""A profile as titles name it (moesim.hw.title)."""

from __future__ import annotations

from moesim.hw.title import profile_title

PARTS = {"gpu": "NVIDIA GeForce RTX 4090", "cpu": "AMD EPYC 7T83 (10 of 64 cores)", "cpu_cores": 10,
         "cpu_dram_bandwidth_gbps": 102.4}


def test_a_profile_given_as_a_path_is_named_by_its_file_as_a_trace_is():
    """The folders made a title as long as the path and wrapped it at a different word for every folder (a
    test's check of 'steps 3-4 of 7' failed when the temporary folder's name grew)."""
    short = "rtx4090.yaml (NVIDIA GeForce RTX 4090 + AMD EPYC 7T83, 10 cores, 102.4 GB/s DRAM)"
    assert profile_title("/tmp/pytest-of-root/pytest-583/popen-gw1/rtx4090.yaml", PARTS) == short
    assert profile_title("hwprofiles/rtx4090.yaml", PARTS) == short
    assert profile_title("rtx4090", PARTS).startswith("rtx4090 (NVIDIA")  # a bundled profile's name as given
    assert profile_title("/data/hw.yaml", None) == "hw.yaml"
