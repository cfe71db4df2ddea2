"""Every number the server reports (``/get_server_info``) is exported by ``/metrics`` with the
kind its producer declared: the shared server runs all three tiers, so the engine's, the
prefix cache's, the L3 tier's, the storage client's and the engine loop's numbers are all here."""


def _types(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            out[name.removesuffix("_total")] = kind  # a counter's samples end in _total
    return out


def test_every_reported_number_is_exported_with_a_declared_kind(server):
    reported = server.client.get("/get_server_info").json()["metrics"]
    r = server.client.get("/metrics")
    assert r.status_code == 200, r.text
    types = _types(r.text)
    assert any(k.startswith("l3_") for k in reported) and any(k.startswith("storage_") for k in reported)
    for key, value in reported.items():
        if key == "sglang_histograms":
            continue  # exported under sglang:* names only (tests/server/test_sglang_metrics.py)
        if key == "histograms":
            for name in value:
                assert types[f"hicache_{name}"] == "histogram", name
            continue
        name = f"hicache_{key.removesuffix('_total')}"
        assert types.get(name) in ("counter", "gauge"), key
