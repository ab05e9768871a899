/* headlab report: attention gallery, enlarged view, attention explorer, sortable table.
 * Everything comes from the JSON block #report-data. Tokens are written with
 * textContent only, so a token that looks like markup stays text. */
(function () {
  "use strict";

  const data = JSON.parse(document.getElementById("report-data").textContent);
  const ROW = 18;             // px per token row in the explorer
  const LINE_LEVELS = 16;     // explorer lines are batched into this many opacity levels

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  /* Whitespace tokens made visible; everything else as is. */
  function shown(token) {
    if (token === "") return "\u2205";
    return token.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
  }

  /* uint8-base64 (L, H, S, S), weight = byte / 255, row-major. */
  function decodeAttention(a) {
    const bin = atob(a.data);
    const bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    const [L, H, S] = a.shape;
    return {
      L, H, S, bytes,
      offset: (l, h) => (l * H + h) * S * S,                   // start of map (l, h)
      weight: (l, h, i, j) => bytes[((l * H + h) * S + i) * S + j] / 255,
    };
  }

  function isPruned(l, h) {
    return Boolean(data.pruned && data.pruned[l] && data.pruned[l][h]);
  }

  /* White to dark blue; shade follows sqrt(weight) so weak patterns stay visible. */
  function paintMap(canvas, att, l, h) {
    const S = att.S;
    canvas.width = S;
    canvas.height = S;
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(S, S);
    const base = att.offset(l, h);
    for (let k = 0; k < S * S; k++) {
      const c = Math.sqrt(att.bytes[base + k] / 255);
      img.data[4 * k] = 255 - c * 247;
      img.data[4 * k + 1] = 255 - c * 207;
      img.data[4 * k + 2] = 255 - c * 148;
      img.data[4 * k + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
  }

  function headLabel(l, h) {
    return "Layer " + l + ", head " + h + (isPruned(l, h) ? " (pruned in this run)" : "");
  }

  function buildGallery(att, tokens) {
    const grid = document.getElementById("gallery-grid");
    for (let l = 0; l < att.L; l++) {
      const row = el("div", "layer-row");
      row.append(el("div", "layer-label", "layer " + l));
      for (let h = 0; h < att.H; h++) {
        const thumb = el("button", "head-thumb" + (isPruned(l, h) ? " pruned" : ""));
        thumb.type = "button";
        thumb.title = headLabel(l, h) + ": click to enlarge";
        const canvas = el("canvas");
        paintMap(canvas, att, l, h);
        thumb.append(canvas, el("span", "", "H" + h + (isPruned(l, h) ? " pruned" : "")));
        thumb.addEventListener("click", () => enlarge(att, tokens, l, h));
        row.append(thumb);
      }
      grid.append(row);
    }
  }

  /* One head's map, large, with query tokens down the side and key tokens on top. */
  function enlarge(att, tokens, l, h) {
    const S = att.S;
    const dialog = document.getElementById("enlarge");
    const grid = document.getElementById("enlarge-grid");
    const readout = document.getElementById("enlarge-readout");
    const room = Math.min(760, window.innerHeight - 240, window.innerWidth - 240);
    const cell = Math.max(6, Math.min(28, Math.floor(room / S)));
    const font = Math.max(7, Math.min(12, cell - 1)) + "px";
    document.getElementById("enlarge-title").textContent = headLabel(l, h);
    readout.textContent = "Hover a cell: query (row) attends to key (column).";

    const cols = el("div", "cols");
    const rows = el("div", "rows");
    tokens.forEach((t) => {
      const c = el("div", "", shown(t));
      c.style.width = cell + "px";
      c.style.fontSize = font;
      c.style.lineHeight = cell + "px";
      cols.append(c);
      const r = el("div", "", shown(t));
      r.style.height = cell + "px";
      r.style.fontSize = font;
      r.style.lineHeight = cell + "px";
      rows.append(r);
    });
    const canvas = el("canvas");
    paintMap(canvas, att, l, h);
    canvas.style.width = S * cell + "px";
    canvas.style.height = S * cell + "px";
    let hot = [];
    canvas.addEventListener("mousemove", (e) => {
      const box = canvas.getBoundingClientRect();
      const j = Math.min(S - 1, Math.floor(((e.clientX - box.left) / box.width) * S));
      const i = Math.min(S - 1, Math.floor(((e.clientY - box.top) / box.height) * S));
      if (i < 0 || j < 0) return;
      readout.textContent = "query " + i + " \u201c" + shown(tokens[i]) + "\u201d \u2192 key " +
        j + " \u201c" + shown(tokens[j]) + "\u201d: " + att.weight(l, h, i, j).toFixed(3);
      hot.forEach((n) => n.classList.remove("hot"));
      hot = [rows.children[i], cols.children[j]];
      hot.forEach((n) => n.classList.add("hot"));
    });
    grid.replaceChildren(el("div"), cols, rows, canvas);
    dialog.showModal();
  }

  function setupDialog() {
    const dialog = document.getElementById("enlarge");
    document.getElementById("enlarge-close").addEventListener("click", () => dialog.close());
    dialog.addEventListener("click", (e) => {
      const box = dialog.getBoundingClientRect();
      const outside = e.clientX < box.left || e.clientX > box.right ||
        e.clientY < box.top || e.clientY > box.bottom;
      if (outside) dialog.close();
    });
  }

  function headColour(h, H) {
    return "hsl(" + Math.round((h * 360) / H) + ", 70%, 42%)";
  }

  /* bertviz-style head view: query tokens left, key tokens right, one line per
   * (query, key, head) with opacity = weight; hovering a token keeps only its lines. */
  function buildExplorer(att, tokens) {
    const S = att.S;
    const select = document.getElementById("explorer-layer");
    const toggles = document.getElementById("explorer-heads");
    const left = document.getElementById("explorer-left");
    const right = document.getElementById("explorer-right");
    const canvas = document.getElementById("explorer-canvas");
    const state = { layer: 0, heads: new Set([...Array(att.H).keys()]), hover: null };

    const ratio = window.devicePixelRatio || 1;
    const width = 260;
    canvas.width = width * ratio;
    canvas.height = S * ROW * ratio;
    canvas.style.width = width + "px";
    canvas.style.height = S * ROW + "px";
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.lineWidth = 1.5;

    function draw() {
      ctx.clearRect(0, 0, width, S * ROW);
      const hv = state.hover;
      [...state.heads].sort((a, b) => a - b).forEach((h) => {
        const levels = Array.from({ length: LINE_LEVELS + 1 }, () => new Path2D());
        for (let i = 0; i < S; i++) {
          if (hv && hv.side === "left" && hv.index !== i) continue;
          for (let j = 0; j < S; j++) {
            if (hv && hv.side === "right" && hv.index !== j) continue;
            const level = Math.round(att.weight(state.layer, h, i, j) * LINE_LEVELS);
            if (level === 0) continue;
            levels[level].moveTo(0, i * ROW + ROW / 2);
            levels[level].lineTo(width, j * ROW + ROW / 2);
          }
        }
        ctx.strokeStyle = headColour(h, att.H);
        levels.forEach((path, level) => {
          if (level === 0) return;
          ctx.globalAlpha = level / LINE_LEVELS;
          ctx.stroke(path);
        });
      });
      ctx.globalAlpha = 1;
    }

    function buildToggles() {
      toggles.replaceChildren();
      for (let h = 0; h < att.H; h++) {
        const b = el("button", isPruned(state.layer, h) ? "pruned" : "", "H" + h);
        b.type = "button";
        b.title = headLabel(state.layer, h);
        b.style.setProperty("--c", headColour(h, att.H));
        b.setAttribute("aria-pressed", String(state.heads.has(h)));
        b.addEventListener("click", () => {
          if (state.heads.has(h)) state.heads.delete(h); else state.heads.add(h);
          b.setAttribute("aria-pressed", String(state.heads.has(h)));
          draw();
        });
        toggles.append(b);
      }
    }

    function tokenColumn(column, side) {
      tokens.forEach((t, index) => {
        const d = el("div", "", shown(t));
        d.title = "token " + index;
        d.addEventListener("mouseenter", () => { state.hover = { side, index }; draw(); });
        d.addEventListener("mouseleave", () => { state.hover = null; draw(); });
        column.append(d);
      });
    }

    for (let l = 0; l < att.L; l++) select.append(new Option("layer " + l, String(l)));
    select.addEventListener("change", () => {
      state.layer = Number(select.value);
      buildToggles();
      draw();
    });
    const setAll = (on) => {
      state.heads = new Set(on ? [...Array(att.H).keys()] : []);
      buildToggles();
      draw();
    };
    document.getElementById("explorer-all").addEventListener("click", () => setAll(true));
    document.getElementById("explorer-none").addEventListener("click", () => setAll(false));
    tokenColumn(left, "left");
    tokenColumn(right, "right");
    buildToggles();
    draw();
  }

  /* Click (or Enter on) a header: largest first, again for smallest first; blanks last. */
  function setupTableSort() {
    const table = document.getElementById("stats-table");
    if (!table) return;
    const headers = [...table.tHead.rows[0].cells];
    const compare = (a, b) => {
      const x = Number(a), y = Number(b);
      return a !== "" && b !== "" && !isNaN(x) && !isNaN(y) ? x - y : a.localeCompare(b);
    };
    headers.forEach((th) => {
      const sort = () => {
        const col = Number(th.dataset.col);
        const dir = th.getAttribute("aria-sort") === "descending" ? "ascending" : "descending";
        headers.forEach((o) => o.setAttribute("aria-sort", "none"));
        th.setAttribute("aria-sort", dir);
        const sign = dir === "ascending" ? 1 : -1;
        const key = (row) => row.cells[col].dataset.sort;
        const rows = [...table.tBodies[0].rows];
        rows.sort((r, s) => {
          const a = key(r), b = key(s);
          if ((a === "") !== (b === "")) return a === "" ? 1 : -1;
          return sign * compare(a, b);
        });
        table.tBodies[0].append(...rows);
      };
      th.addEventListener("click", sort);
      th.addEventListener("keydown", (e) => {
        if (e.key === "Enter" || e.key === " ") { e.preventDefault(); sort(); }
      });
    });
  }

  setupTableSort();
  setupDialog();
  if (data.sample) {
    const att = decodeAttention(data.sample.attention);
    buildGallery(att, data.sample.tokens);
    buildExplorer(att, data.sample.tokens);
  }
})();
