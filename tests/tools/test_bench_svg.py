"""``tools/bench_svg.py``: the bench's hand-written SVG plots are well-formed and show what they are given."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from enginelink.tools.bench_svg import LinePanel, RangePanel, render


def test_panels_render_as_well_formed_svg_with_every_series_named():
    svg = render([
        LinePanel("servicer RSS", "minutes", "MiB", [("rss", [0, 1, 2], [80.0, 81.5, 81.2])], [(1.0, "engine killed")]),
        RangePanel("inter-token p99", "ms", ["c=32", "c=128"],
                   [("enginelink", [(41.0, 40.0, 43.5), (45.0, 44.0, 47.0)]), ("smg-rust", [None, (46.0, 45.0, 48.0)])]),
    ], "a title & more", note="a note")
    root = ET.fromstring(svg)  # well-formed XML, the title escaped
    assert root.tag.endswith("svg")
    texts = [t.text for t in root.iter() if t.tag.endswith("text")]
    for shown in ("a title & more", "servicer RSS", "engine killed", "enginelink", "smg-rust", "c=128"):
        assert shown in texts
    # One point per (series, group) given; None is drawn as nothing.
    assert sum(1 for e in root.iter() if e.tag.endswith("circle")) == 3
    assert render([], "empty").startswith("<svg")
