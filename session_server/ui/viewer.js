// tokenkeep rollout viewer. Plain JavaScript, no dependencies, no build step.
// Everything shown comes from a model or a harness: it is inserted with textContent only,
// never as markup.
"use strict";

const KEY_STORAGE = "tokenkeep-admin-key";
const BLOCK = 1024; // tokens rendered together, when their block scrolls near the screen
const PAGE = 50;

const main = document.getElementById("main");
const crumb = document.getElementById("crumb");

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

class AuthRequired extends Error {}

async function api(path) {
  const headers = {};
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) headers["Authorization"] = "Bearer " + key;
  const response = await fetch(path, { headers });
  if (response.status === 401 || response.status === 403) throw new AuthRequired();
  const body = await response.json();
  if (!response.ok) {
    const message = (body && body.error && body.error.message) || response.statusText;
    throw new Error(message);
  }
  return body;
}

function askForKey() {
  const form = document.getElementById("key-form");
  form.hidden = false;
  main.replaceChildren(el("p", { class: "error", text: "This server needs an admin key." }));
  form.onsubmit = (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORAGE, document.getElementById("key-input").value);
    form.hidden = true;
    route();
  };
}

function fail(error) {
  if (error instanceof AuthRequired) return askForKey();
  main.replaceChildren(el("p", { class: "error", text: "Error: " + error.message }));
}

function when(seconds) {
  return new Date(seconds * 1000).toLocaleString();
}

function breaksText(breaks) {
  const parts = Object.entries(breaks || {}).map(([reason, n]) => `${reason} ×${n}`);
  return parts.length ? parts.join(", ") : "none";
}

// --- the session list -------------------------------------------------------------------

function stateSelect(current) {
  const select = el("select", { name: "state" });
  for (const [value, label] of [["", "any state"], ["running", "running"], ["finished", "finished"]]) {
    const option = el("option", { value, text: label });
    if (value === current) option.selected = true;
    select.append(option);
  }
  return select;
}

async function showList() {
  crumb.textContent = "sessions";
  const params = new URLSearchParams(location.search);
  const offset = Math.max(0, parseInt(params.get("offset") || "0", 10) || 0);
  const query = new URLSearchParams({ offset: String(offset), limit: String(PAGE) });
  for (const name of ["q", "metadata", "state"]) {
    if (params.get(name)) query.set(name, params.get(name));
  }
  const data = await api("/ui/api/sessions?" + query);
  const filter = el(
    "form",
    { class: "filter", method: "get", action: "/ui/" },
    el("input", { name: "q", placeholder: "id contains", value: params.get("q") || "" }),
    el("input", {
      name: "metadata",
      placeholder: "metadata key=value,…",
      value: params.get("metadata") || "",
    }),
    stateSelect(params.get("state") || ""),
    el("button", { type: "submit", text: "Filter" }),
  );
  const rows = data.sessions.map((s) =>
    el(
      "tr",
      {},
      el("td", {}, el("a", { href: "/ui/sessions/" + encodeURIComponent(s.id), text: s.id })),
      el("td", { text: when(s.created_at) }),
      el("td", { class: "num", text: s.turns }),
      el("td", { class: "num", text: s.segments }),
      el("td", { text: breaksText(s.breaks) }),
      el("td", { class: "num", text: s.tokens }),
      el("td", { text: s.state }),
      el("td", { class: "num", text: s.reward === null ? "—" : String(s.reward) }),
      el("td", { class: "meta", text: JSON.stringify(s.metadata || {}) }),
    ),
  );
  const table = el(
    "table",
    { class: "sessions" },
    el(
      "thead",
      {},
      el(
        "tr",
        {},
        ...[
          "session",
          "created",
          "turns",
          "segments",
          "breaks",
          "tokens",
          "state",
          "reward",
          "metadata",
        ].map((h) =>
          el("th", { text: h }),
        ),
      ),
    ),
    el("tbody", {}, ...rows),
  );
  const pager = el("p", { class: "pager" });
  const link = (label, to) => {
    const next = new URLSearchParams(params);
    next.set("offset", String(to));
    return el("a", { href: "/ui/?" + next, text: label });
  };
  if (offset > 0) pager.append(link("← newer", Math.max(0, offset - PAGE)), " ");
  pager.append(
    `${data.total ? offset + 1 : 0}–${offset + data.sessions.length} of ${data.total}`,
  );
  if (offset + PAGE < data.total) pager.append(" ", link("older →", offset + PAGE));
  main.replaceChildren(filter, table, pager);
}

// --- one session ------------------------------------------------------------------------

function turnTree(turns, selectedLeaf, onPick) {
  const children = new Map();
  for (const t of turns) {
    const key = t.parent_id === null ? 0 : t.parent_id;
    if (!children.has(key)) children.set(key, []);
    children.get(key).push(t);
  }
  const build = (parent) => {
    const list = el("ul", {});
    for (const t of children.get(parent) || []) {
      const label = el(
        "button",
        { class: "turn kind-" + t.kind, type: "button", "data-turn": t.turn_id },
        `#${t.turn_id} ${t.kind} · ${t.api} · ${t.finish_reason} · ${t.completion_tokens} sampled`,
      );
      if (t.break_reason) label.append(el("span", { class: "reason", text: " " + t.break_reason }));
      if (t.turn_id === selectedLeaf) label.classList.add("selected");
      label.addEventListener("click", () => onPick(t.turn_id));
      list.append(el("li", {}, label, children.has(t.turn_id) ? build(t.turn_id) : null));
    }
    return list;
  };
  return build(0);
}

function colourFor(logprob) {
  const p = Math.exp(logprob);
  return `hsl(${Math.round(120 * p)}, 70%, 82%)`;
}

const CHAR_PX = 7.9; // 13px monospace
const TOKEN_PX = 5; // a token's border, padding and margin
const LINE_PX = 24.7; // 13px x line-height 1.9

function estimatedHeight(segment, start, end, width) {
  let pixels = 0;
  let lines = 1;
  for (let i = start; i < end; i++) {
    const piece = segment.pieces[i];
    pixels += piece.length * CHAR_PX + TOKEN_PX;
    const breaks = piece.split("\n").length - 1;
    if (breaks) {
      lines += breaks + Math.floor(pixels / width);
      pixels = 0;
    }
  }
  return Math.ceil((lines + pixels / width) * LINE_PX);
}

// An image's placeholder run is drawn as one thumbnail block at its first position; its other
// positions draw nothing (a run may cross a block boundary).
function imageRuns(segment) {
  if (!segment.imageAt) {
    segment.imageAt = new Map();
    for (const image of segment.images || []) {
      for (let i = image.offset; i < image.offset + image.length; i++) {
        segment.imageAt.set(i, image);
      }
    }
  }
  return segment.imageAt;
}

function imageBlock(image, position) {
  const block = el("span", {
    class: "t c img",
    title: `image ${image.width}x${image.height}, ${image.length} placeholder tokens, ` +
      `sha256 ${image.sha256.slice(0, 12)}…`,
  });
  block.dataset.i = String(position);
  if (image.thumbnail) block.append(el("img", { src: image.thumbnail, alt: "image" }));
  block.append(el("span", { text: ` ${image.length} tokens` }));
  return block;
}

function renderBlock(container, segment, start, end, ctx) {
  const fragment = document.createDocumentFragment();
  const runs = imageRuns(segment);
  for (let i = start; i < end; i++) {
    const image = runs.get(i);
    if (image) {
      if (i === image.offset) fragment.append(imageBlock(image, i));
      continue;
    }
    const classes = ["t", segment.loss_mask[i] ? "s" : "c"];
    if (segment.special[i]) classes.push("sp");
    const piece = segment.pieces[i];
    const span = document.createElement("span");
    span.className = classes.join(" ");
    span.dataset.i = String(i);
    span.textContent = piece === "" ? "∅" : piece.replace(/\n/g, "↵\n");
    if (ctx.logprobColours && segment.logprobs[i] !== null) {
      span.style.backgroundColor = colourFor(segment.logprobs[i]);
    }
    fragment.append(span);
  }
  container.replaceChildren(fragment);
  container.style.height = "";
  container.classList.add("rendered");
}

function turnAt(segment, position) {
  for (const turn of segment.turns) {
    if (position >= turn.prompt_span[0] && position < turn.completion_span[1]) return turn;
  }
  return null;
}

function versionAt(segment, position) {
  for (const span of segment.weight_versions || []) {
    if (position >= span.start && position < span.end) return span.version;
  }
  return null;
}

function describeToken(segment, position) {
  const turn = turnAt(segment, position);
  const lp = segment.logprobs[position];
  const rows = [
    ["position", position],
    ["token id", segment.token_ids[position]],
    ["piece", JSON.stringify(segment.pieces[position])],
    ["sampled", segment.loss_mask[position] ? "yes (loss 1)" : "no: context (loss 0)"],
    ["logprob", lp === null ? "—" : lp.toFixed(4)],
    ["special", segment.special[position] ? "yes" : "no"],
  ];
  if (turn) {
    rows.push(["turn", `#${turn.turn_id} (${turn.kind})`], ["api", turn.api]);
    rows.push(["finish reason", turn.finish_reason]);
  }
  const version = versionAt(segment, position);
  if (version !== null) rows.push(["policy version", version]);
  return el(
    "dl",
    {},
    ...rows.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: String(v) })]),
  );
}

function drawBranch(view, branch, ctx) {
  const detail = el("div", { id: "detail", class: "detail" }, "Hover or select a token.");
  const segments = el("div", { class: "segments" });
  view.replaceChildren(segments, detail);
  ctx.width = Math.max(200, segments.clientWidth);
  const observer = new IntersectionObserver(
    (entries) => {
      for (const entry of entries) {
        if (!entry.isIntersecting) continue;
        const block = entry.target;
        observer.unobserve(block);
        const segment = branch.segments[Number(block.dataset.segment)];
        renderBlock(block, segment, Number(block.dataset.start), Number(block.dataset.end), ctx);
      }
    },
    { rootMargin: "1500px 0px" },
  );
  for (const segment of branch.segments) {
    const started =
      segment.start_reason === "first"
        ? "starts the session"
        : "new segment: " + segment.start_reason;
    const header = el(
      "div",
      {
        class: "segment-head" + (segment.start_reason === "first" ? "" : " break"),
        "data-segment": segment.index,
      },
      el("strong", { text: `Segment ${segment.index + 1}` }),
      ` · ${segment.token_ids.length} tokens · ${
        segment.loss_mask.filter((m) => m).length
      } sampled · `,
      el("span", { class: "reason", text: started }),
    );
    const body = el("div", { class: "tokens" });
    segments.append(el("section", { class: "segment" }, header, body));
    for (let start = 0; start < segment.token_ids.length; start += BLOCK) {
      const end = Math.min(start + BLOCK, segment.token_ids.length);
      const block = el("div", {
        class: "block",
        "data-segment": segment.index,
        "data-start": start,
        "data-end": end,
      });
      // Until it is drawn, a block takes about the room its tokens will: only the blocks
      // near the screen are drawn, so a 128k-token session never lays out 128k spans at once.
      block.style.height = estimatedHeight(segment, start, end, ctx.width) + "px";
      body.append(block);
      observer.observe(block);
    }
    const show = (event) => {
      const target = event.target;
      if (!(target instanceof HTMLElement) || !target.classList.contains("t")) return;
      detail.replaceChildren(describeToken(segment, Number(target.dataset.i)));
      if (event.type === "click") {
        for (const old of document.querySelectorAll(".t.picked")) old.classList.remove("picked");
        target.classList.add("picked");
      }
    };
    body.addEventListener("mouseover", show);
    body.addEventListener("click", show);
  }
}

async function showSession(sessionId) {
  crumb.textContent = "session " + sessionId;
  const data = await api("/ui/api/sessions/" + encodeURIComponent(sessionId));
  const ctx = { logprobColours: false, branch: data.branches.length - 1 };
  const params = new URLSearchParams(location.search);
  if (params.has("branch")) ctx.branch = Math.min(Number(params.get("branch")) || 0, ctx.branch);
  const summary = el(
    "p",
    { class: "summary" },
    `${data.turns} turns · ${data.branches.length} branches · ${data.segments} segments · ` +
      `${data.tokens} tokens (${data.sampled_tokens} sampled) · breaks: ${breaksText(data.breaks)}` +
      ` · model ${data.model} · ${data.state}` +
      (data.reward === null ? "" : ` · reward ${data.reward}`),
  );
  const view = el("div", { class: "branch-view" });
  const tree = el("nav", { class: "tree" });
  const branchSelect = el("select", { id: "branch" });
  data.branches.forEach((b, i) => {
    const option = el("option", { value: String(i), text: `branch ${i} (leaf #${b.leaf_turn_id})` });
    if (i === ctx.branch) option.selected = true;
    branchSelect.append(option);
  });
  const leafBranch = new Map();
  data.branches.forEach((b, i) => {
    for (const segment of b.segments) for (const t of segment.turns) leafBranch.set(t.turn_id, i);
  });
  const redraw = () => {
    const branch = data.branches[ctx.branch];
    branchSelect.value = String(ctx.branch);
    tree.replaceChildren(
      el("h3", { text: "Turn tree" }),
      turnTree(data.turn_tree, branch ? branch.leaf_turn_id : null, (turnId) => {
        ctx.branch = leafBranch.get(turnId) ?? ctx.branch;
        redraw();
      }),
    );
    if (branch) drawBranch(view, branch, ctx);
    else view.replaceChildren(el("p", { class: "muted", text: "No turns yet." }));
  };
  branchSelect.addEventListener("change", () => {
    ctx.branch = Number(branchSelect.value);
    redraw();
  });
  const colours = el("input", { type: "checkbox", id: "logprob-colours" });
  colours.addEventListener("change", () => {
    ctx.logprobColours = colours.checked;
    redraw();
  });
  let breakCursor = -1;
  const nextBreak = el("button", { type: "button", id: "next-break", text: "Next break ↓" });
  nextBreak.addEventListener("click", () => {
    const heads = [...document.querySelectorAll(".segment-head.break")];
    if (!heads.length) return;
    breakCursor = (breakCursor + 1) % heads.length;
    heads[breakCursor].scrollIntoView({ block: "start" });
    for (const h of heads) h.classList.remove("current");
    heads[breakCursor].classList.add("current");
  });
  const controls = el(
    "div",
    { class: "controls" },
    el("label", {}, "Branch ", branchSelect),
    el("label", {}, colours, " logprob colours"),
    nextBreak,
    el(
      "span",
      { class: "legend" },
      el("span", { class: "t s", text: "sampled" }),
      el("span", { class: "t c", text: "context" }),
      el("span", { class: "t c sp", text: "special" }),
    ),
  );
  main.replaceChildren(summary, controls, el("div", { class: "layout" }, tree, view));
  redraw();
}

function route() {
  const match = location.pathname.match(/^\/ui\/sessions\/([^/]+)$/);
  const work = match ? showSession(decodeURIComponent(match[1])) : showList();
  work.catch(fail);
}

route();
