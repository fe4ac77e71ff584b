"""`compare` names a run's routing setting fully: which sublayers a router routes and whether
skipped tokens stay attendable tell apart runs of one router with the same options."""

from nag_lightning.analysis.reports.compare import router_setting


def test_router_column_names_options_and_where_it_routes():
    base = {"router": "threshold", "router_options": {"predictor": "angle", "target_rate": 0.5}}
    assert router_setting({**base, "route_kinds": ["attn", "mlp"], "route_layers": "all"}) == (
        "threshold predictor=angle, target_rate=0.5")
    assert router_setting({**base, "route_kinds": ["mlp"]}) == (
        "threshold predictor=angle, target_rate=0.5; routes mlp")
    assert router_setting({**base, "route_layers": "inner", "attend_skipped": True}) == (
        "threshold predictor=angle, target_rate=0.5; layers inner; skipped tokens attendable")
    warm = {"router": "topk", "router_options": {"capacity": 0.75, "full_depth_share": 0.25}}
    assert router_setting(warm) == "topk capacity=0.75, full_depth_share=0.25"
    late = {"router": "threshold",
            "router_options": {"predictor": "angle", "angle_cost": 0.08, "price_start": 0.6}}
    assert router_setting(late) == "threshold predictor=angle, angle_cost=0.08, price_start=0.6"


def test_unrouted_run_has_no_routing_details():
    assert router_setting({"router": "none", "route_kinds": ["mlp"], "attend_skipped": True}) == "none"
