"""Tests of parallel_state_ng.layout: the pure layout math, against MCore's RankGenerator too."""
