"""The analysis figures: real PNGs of the documented size with data drawn on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergekit_ram.analysis import figures
from mergekit_ram.analysis.report import PAPER_DEFAULTS, Analysis, build_report
from mergekit_ram.core.counting import OverlapStatistics

PLOTS = "the figures need the plots extra: pip install 'mergekit-ram[plots]'"
pytest.importorskip("matplotlib", reason=PLOTS)
Image = pytest.importorskip("PIL.Image", reason=PLOTS)

EPSILON = 1e-5
VIRIDIS_FIRST = (68, 1, 84)  # overlap k = 0 (unique) segments
TAB10_FIRST = (31, 119, 180)  # first task's line
BLUES_LAST = (8, 48, 107)  # Jaccard 1.0 on the diagonal


def llama_names(layers: int) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (24, 8)}
    for i in range(layers):
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (8,)
        shapes[f"model.layers.{i}.self_attn.q_proj.weight"] = (8, 8)
        shapes[f"model.layers.{i}.mlp.up_proj.weight"] = (16, 8)
    shapes["model.norm.weight"] = (8,)
    shapes["lm_head.weight"] = (24, 8)
    return shapes


def make_report(densities, shapes, seed=0, inner_products=True) -> dict:
    """A report from the statistics engine on seeded sparse task vectors."""
    g = torch.Generator().manual_seed(seed)
    stats = OverlapStatistics(epsilon=EPSILON, inner_products=inner_products)
    for index, (name, shape) in enumerate(shapes.items()):
        base = torch.randn(shape, generator=g)
        tasks = {}
        for t, density in enumerate(densities):
            skew = 1.0 + 0.5 * ((index + t) % 3 - 1)
            keep = torch.rand(shape, generator=g) < density * skew
            tasks[f"/models/agent{t}"] = base + 0.01 * keep
        stats.add(name, base, tasks)
    scales = stats.scales(PAPER_DEFAULTS.rule)
    return build_report(
        Analysis("ramplus", "/models/base", PAPER_DEFAULTS, stats, scales)
    )


def rgb(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int32)


def has_colour(image, colour, tolerance=12) -> bool:
    close = np.abs(rgb(image) - np.array(colour, dtype=np.int32)) <= tolerance
    return bool(close.all(axis=-1).any())


def assert_not_blank(image):
    array = rgb(image)
    assert array.var() > 0
    packed = (array[..., 0] << 16) | (array[..., 1] << 8) | array[..., 2]
    assert len(np.unique(packed)) > 20
    # More than a sliver of the canvas is ink, not background.
    white = (array == 255).all(axis=-1).mean()
    assert white < 0.95


def drawn(report, folder) -> dict:
    """Every figure of `report` drawn into `folder`: PNGs of the documented
    size, none blank."""
    names = figures.write_figures(report, str(folder))
    assert names == list(figures.FIGURES)
    images = {name: Image.open(folder / name) for name in names}
    for name, image in images.items():
        width, height = figures.FIGURES[name]
        assert image.format == "PNG"
        assert image.size == (round(width * figures.DPI), round(height * figures.DPI))
        assert_not_blank(image)
    return images


def test_figures_show_the_data(tmp_path):
    images = drawn(make_report([0.05, 0.3, 0.5], llama_names(3)), tmp_path)
    assert has_colour(images["overlap_histogram.png"], VIRIDIS_FIRST)
    assert has_colour(images["density_per_layer.png"], TAB10_FIRST)
    assert has_colour(images["jaccard.png"], BLUES_LAST)
    # regime.png: RAM's retention bars (first tab10 colour), lift bars (viridis).
    assert has_colour(images["regime.png"], TAB10_FIRST)
    assert has_colour(images["regime.png"], VIRIDIS_FIRST)
    # Figures change with the data.
    other = make_report([0.4, 0.1, 0.2], llama_names(3), seed=5)
    figures.write_figures(other, str(tmp_path / "other"))
    for name in figures.FIGURES:
        assert (tmp_path / name).read_bytes() != (
            tmp_path / "other" / name
        ).read_bytes()


# One task: every change unique, 1×1 Jaccard; a task identical to the base;
# no layered tensors; more tasks than tab10 has colours.
EDGES = [([0.3], 2), ([0.2, 0.0, 0.4], 2), ([0.2, 0.3], 0)]
EDGES += [([0.05 * (i + 1) for i in range(12)], 2)]


@pytest.mark.parametrize(
    ("densities", "layers"), EDGES, ids=["one", "empty", "no-layers", "twelve"]
)
def test_edge_cases_still_draw(densities, layers, tmp_path):
    drawn(make_report(densities, llama_names(layers)), tmp_path)


def test_regime_figure_without_retention(tmp_path):
    # Statistics counted without inner products (Python API): no bars, a note.
    report = make_report([0.2, 0.3], llama_names(1), inner_products=False)
    assert report["retention"] is None
    assert all(t["retention"] is None for t in report["tasks"])
    assert not has_colour(drawn(report, tmp_path)["regime.png"], TAB10_FIRST)
