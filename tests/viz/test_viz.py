"""Pictures: the SVG Gantt chart (parsed, and rendered to pixels when rsvg-convert is installed), the terminal
grid and the simulated Chrome trace."""

from __future__ import annotations

import itertools
import json
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib

import pytest

import pipec
from pipec.cli import main
from pipec.ir import Kind
from pipec.sim import parse_costs, simulate
from pipec.viz.grid import render_grid
from pipec.viz.svg import colour, render_svg
from pipec.viz.timeline import sim_trace

NS = "{http://www.w3.org/2000/svg}"


def _boxes(svg: str) -> list[tuple[str, float, float, float, str]]:
    """(action text, x, y, width, fill) of every compute box, read back from the SVG."""
    root = ET.fromstring(svg)
    out = []
    for rect in root.iter(NS + "rect"):
        title = rect.find(NS + "title")
        if title is not None and "(chunk" in title.text:
            out.append(
                (
                    title.text.split()[0],
                    float(rect.get("x")),
                    float(rect.get("y")),
                    float(rect.get("width")),
                    rect.get("fill"),
                )
            )
    return out


def test_svg_has_every_compute_op_once_in_its_colour():
    program = pipec.compile("interleaved_1f1b", 4, 8, 2)
    result = simulate(program, record=True, p2p="ideal")
    svg = render_svg(result)
    boxes = _boxes(svg)
    expected = sorted(str(a) for stream in program.compute_streams() for ins in stream for a in ins.parts)
    assert sorted(b[0] for b in boxes) == expected
    for text, _x, _y, _w, fill in boxes:
        action = pipec.parse_instruction(text)
        chunk = program.stages_of(program.stage_to_rank[action.stage]).index(action.stage)
        assert fill == colour(action.kind, chunk, 2)
    assert colour(Kind.F, 0, 2) != colour(Kind.F, 1, 2) != colour(Kind.B, 1, 2)
    title = ET.fromstring(svg).find(NS + "text").text
    assert "P=4" in title and "M=8" in title and "V=2" in title and "makespan 57" in title and "bubble 15.8%" in title


def test_svg_geometry_follows_the_timeline():
    result = simulate(pipec.load("1f1b", 4, 8), parse_costs("F=1,B=2"), record=True, p2p="ideal")
    boxes = {b[0]: b for b in _boxes(render_svg(result, width=1100))}
    scale = (1100 - 58 - 20) / result.makespan
    # the first backward reaches rank 0 at 2(P-1) + ... = 3 + 3 * 2 + 1 = 10 (F chain 4, B chain 6)
    b0 = boxes["0B0"]
    assert b0[1] == pytest.approx(58 + 10 * scale, abs=0.06) and b0[3] == pytest.approx(2 * scale, abs=0.06)
    f3 = boxes["0F3"]
    assert f3[1] + f3[3] == pytest.approx(58 + 4 * scale, abs=0.06)  # rank 0 then idles from 4 to 10: a bubble
    rows = sorted({b[2] for b in boxes.values()})
    assert len(rows) == 4  # one row per rank


def _png_pixels(path) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA PNG (what rsvg-convert writes) into rows of bytes; no imaging library needed."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour_type = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour_type in (2, 6)
            channels = 4 if colour_type == 6 else 3
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, previous = [], bytearray(stride)
    for y in range(height):
        filter_type, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if filter_type == 1:
                line[i] = (line[i] + left) & 255
            elif filter_type == 2:
                line[i] = (line[i] + up) & 255
            elif filter_type == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif filter_type == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        rows.append(bytes(line))
        previous = line
    return width, channels, rows


@pytest.mark.skipif(shutil.which("rsvg-convert") is None, reason="rsvg-convert (librsvg2-bin) is not installed")
def test_svg_renders_with_boxes_and_bubbles_where_the_timeline_says(tmp_path):
    result = simulate(pipec.load("1f1b", 4, 8), parse_costs("F=1,B=2"), record=True, p2p="ideal")
    svg_path, png_path = tmp_path / "1f1b.svg", tmp_path / "1f1b.png"
    svg_path.write_text(render_svg(result, width=1100))
    subprocess.run(["rsvg-convert", "-o", str(png_path), str(svg_path)], check=True, timeout=60)
    _width, channels, rows = _png_pixels(png_path)
    scale = (1100 - 58 - 20) / result.makespan

    def pixel(t: float, rank: int) -> tuple[int, int, int]:
        x, y = round(58 + t * scale), round(44 + rank * 32 + 5)  # near the top of the row, away from labels
        return tuple(rows[y][x * channels : x * channels + 3])

    assert pixel(0.5, 0) == tuple(int(colour(Kind.F)[i : i + 2], 16) for i in (1, 3, 5))  # 0F0
    assert pixel(11.0, 0) == tuple(int(colour(Kind.B)[i : i + 2], 16) for i in (1, 3, 5))  # 0B0 from 10 to 12
    assert pixel(7.0, 0) == (255, 255, 255)  # rank 0 waits from 4 to 10: white
    assert pixel(1.5, 3) == (255, 255, 255)  # rank 3 has not started yet


def test_grid_is_the_step_picture():
    result = simulate(pipec.load("1f1b", 2, 3), parse_costs("F=1,B=1"), record=True, p2p="ideal")
    lines = render_grid(result).splitlines()
    assert lines[0].endswith("one column = 1 time unit")  # singular
    assert lines[1:] == [
        "rank 0  |F0 F1 .  B0 F2 B1 .  B2",
        "rank 1  |.  F0 B0 F1 B1 F2 B2 .",
        "legend: F0 forward of micro-batch 0, B backward, . idle",
    ]
    chunked = render_grid(simulate(pipec.load("zbv", 2, 4, 2), record=True, p2p="ideal"))
    assert "F0.0" in chunked and "F0.1" in chunked and "I0.1" in chunked
    assert "F0.1 forward of micro-batch 0 on the rank's chunk 1, I input gradient, W weight gradient" in chunked


def _grid_symbols(text: str) -> set[str]:
    """The symbols of a grid's cells: op labels reduced to their kind letters, `--`, `.`, `~` and `+`."""
    symbols: set[str] = set()
    for line in text.splitlines():
        if line.startswith("rank "):
            for cell in line.split("|", 1)[1].split():
                if cell[0] in "FBIW":
                    symbols.update(part[0] for part in cell.split("+"))
                    if "+" in cell:
                        symbols.add("+")
                    if "." in cell:
                        symbols.add(".1")  # a chunk suffix
                else:
                    symbols.add(cell)
    return symbols


@pytest.mark.parametrize(
    ("name", "chunks", "p2p", "cost"),
    [
        ("1f1b", 1, "nccl", "F=1,B=2"),  # --, . and ~ (send/recv batches that take time)
        ("dualpipev", 2, "ideal", "F=1,B=2,W=1"),  # overlapped pairs and chunks
        ("zbv", 2, "nccl", "F=1,B=2,W=1,comm=0.5"),
    ],
)
def test_grid_legend_names_every_symbol_it_uses(name, chunks, p2p, cost):
    text = render_grid(simulate(pipec.compile(name, 4, 8, chunks), parse_costs(cost), record=True, p2p=p2p))
    legend = next(line for line in text.splitlines() if line.startswith("legend: "))
    meaning = {
        "F": "F0", "B": "B backward", "I": "I input gradient", "W": "W weight gradient", "--": "-- the op goes on",
        ".": ". idle", "~": "~ idle while a send/recv batch", "+": "+ joins the halves of an overlapped pair",
        ".1": "on the rank's chunk 1",
    }
    used = _grid_symbols(text)
    assert used >= {"F", "--", "."}
    for symbol, words in meaning.items():
        assert (words in legend) == (symbol in used), (symbol, legend)
    assert "note:" not in text  # one column per shortest op: nothing is merged


def test_grid_says_when_a_column_merges_ops():
    """With F 2000 times shorter than B the grid needs a column of makespan / 400: the forwards of a rank start in
    one column and all but the last are drawn over; the note gives the resolution and the count."""
    result = simulate(pipec.load("gpipe", 2, 3), parse_costs("F=0.001"), record=True, p2p="ideal")
    text = render_grid(result, max_columns=400)
    slot = result.makespan / 400
    assert text.splitlines()[0].endswith(f"one column = {slot:g} time units")
    assert text.splitlines()[1].startswith("rank 0  |F2 .")  # 0F0 and 0F1 are hidden behind 0F2
    note = text.splitlines()[-1]
    assert note.startswith(f"note: one column = {slot:g} time units (400 columns at most), coarser than the shortest")
    assert "(0.001 time units)" in note and "5 ops are drawn over by a later op" in note  # 2 on rank 0, 3 on rank 1
    roomy = render_grid(result, max_columns=10_000)  # a column per shortest op again: every op shows
    assert "note:" not in roomy and all(f"F{m}" in roomy.splitlines()[1] for m in range(3))


def test_grid_notes_ops_that_take_no_time():
    result = simulate(pipec.compile("zb_h1", 2, 2), parse_costs("F=1,B=2,W=0"), record=True)
    text = render_grid(result)
    hidden = 4 - sum(line.count("W") for line in text.splitlines()[1:3])  # 2 ranks x 2 micro-batches of W
    assert hidden > 0
    plural = "1 op takes no time and is" if hidden == 1 else f"{hidden} ops take no time and are"
    assert text.splitlines()[-1] == f"note: {plural} drawn over by the next op; `pipec viz` draws every op"


def test_sim_trace_has_true_durations_and_a_flow_per_message():
    result = simulate(pipec.compile("1f1b", 3, 4), parse_costs("F=1,B=2,comm=0.5"), record=True)
    trace = sim_trace(result)
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == sum(len(line) for line in result.timeline)
    for e in complete:
        if e["cat"] == "F":
            assert e["dur"] == pytest.approx(1000.0)  # 1 cost unit is shown as 1 ms
        if e["cat"] == "B":
            assert e["dur"] == pytest.approx(2000.0)
    starts = [e for e in events if e["ph"] == "s"]
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == len(result.messages) == 2 * 2 * 4  # (P-1) hops, both directions, M micro-batches
    by_track: dict[int, list[dict]] = {}
    for e in complete:
        by_track.setdefault(e["tid"], []).append(e)
    for s in starts:
        f = finishes[s["id"]]
        assert f["ts"] - s["ts"] == pytest.approx(500.0)
        for point in (s, f):  # each end of a flow lies on a send/recv slice of its own rank
            assert any(
                e["cat"] == "comm" and e["ts"] - 1e-6 <= point["ts"] <= e["ts"] + e["dur"] + 1e-6
                for e in by_track[point["tid"]]
            )
    # batches run on the communication stream beside compute (p2p rule v2): their own track per rank, so the
    # slices of one track never overlap
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2", 3: "rank 0 p2p", 4: "rank 1 p2p", 5: "rank 2 p2p"}
    for tid, slices in by_track.items():
        assert {e["cat"] == "comm" for e in slices} == {tid >= 3}
        slices.sort(key=lambda e: e["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-6 for a, b in itertools.pairwise(slices))


def test_viz_and_show_commands(tmp_path, capsys):
    svg, trace = tmp_path / "s.svg", tmp_path / "t.json"
    assert (
        main(
            [
                "viz",
                "zbv",
                "-P",
                "4",
                "-M",
                "8",
                "-V",
                "2",
                "--p2p",
                "ideal",
                "-o",
                str(svg),
                "--trace",
                str(trace),
                "--arrows",
            ]
        )
        == 0
    )
    root = ET.fromstring(svg.read_text())
    assert root.tag == NS + "svg" and len(list(root.iter(NS + "line"))) > 10  # arrows and the axis
    assert {e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["name"] == "thread_name"} == {
        f"rank {r}" for r in range(4)
    }
    assert main(["viz", "zbv", "-P", "4", "-M", "8"]) == 2
    assert "needs -o" in capsys.readouterr().err
    assert main(["show", "gpipe", "-P", "2", "-M", "2", "--cost", "F=1,B=1", "--p2p", "ideal"]) == 0
    assert "rank 1  |.  F0 F1 B0 B1" in capsys.readouterr().out


def test_large_pictures_drop_labels_but_keep_every_box(monkeypatch):
    import pipec.viz.svg as svg_module

    monkeypatch.setattr(svg_module, "DETAIL_LIMIT", 10)
    result = simulate(pipec.load("gpipe", 2, 4), record=True, p2p="ideal")
    root = ET.fromstring(svg_module.render_svg(result))
    fills = {colour(Kind.F), colour(Kind.B)}
    boxes = [r for r in root.iter(NS + "rect") if r.get("fill") in fills and r.get("height") == "26.0"]
    assert len(boxes) == 2 * 2 * 4 and all(r.find(NS + "title") is None for r in boxes)
