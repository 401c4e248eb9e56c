"""Cluster resume tokens and merged metrics: pure functions, no Ray needed."""

from __future__ import annotations

import pytest

from web.cluster.metrics import merge
from web.cluster.tokens import TokenSigner

SECRET = b"s" * 32


def test_a_token_names_its_replica_and_an_altered_one_names_none() -> None:
    signer = TokenSigner(SECRET)
    token = signer.issue("replica-1")
    assert signer.replica_of(token) == "replica-1"
    replica, rand, mac = token.split(".")
    flipped = rand[:-1] + ("A" if rand[-1] != "A" else "B")
    assert signer.replica_of(f"{replica}.{flipped}.{mac}") is None  # the random part changed
    assert signer.replica_of(f"replica-0.{rand}.{mac}") is None  # sent to another replica
    assert signer.replica_of(TokenSigner(b"t" * 32).issue("replica-1")) is None  # another cluster
    assert signer.replica_of("") is None and signer.replica_of("...") is None
    assert signer.issue("replica-1") != token  # random


def test_a_bad_replica_name_or_short_secret_is_refused() -> None:
    with pytest.raises(ValueError):
        TokenSigner(b"short")
    with pytest.raises(ValueError):
        TokenSigner(SECRET).issue("Replica.0")


def test_merged_metrics_label_every_sample_and_keep_families_whole() -> None:
    head = b"# HELP x_total things\n# TYPE x_total counter\n"
    a = head + b'x_total 3.0\n# HELP y y\n# TYPE y gauge\ny{k="v"} 1.0\n'
    b = head + b'x_total 4.0\n# HELP y y\n# TYPE y gauge\ny{k="w"} 2.0\n'
    text = merge({"replica-0": a, "replica-1": b}, {"worldserve_cluster_replicas": (2, "replicas")}).decode()
    lines = text.splitlines()
    assert lines[:4] == [
        "# HELP x_total things",
        "# TYPE x_total counter",
        'x_total{replica="replica-0"} 3.0',
        'x_total{replica="replica-1"} 4.0',
    ]
    assert 'y{replica="replica-0",k="v"} 1.0' in lines and 'y{replica="replica-1",k="w"} 2.0' in lines
    assert lines.count("# TYPE y gauge") == 1
    assert lines[-1] == "worldserve_cluster_replicas 2"
