// The heads-up display: connection, codec, fps, latency, timings, buffer; and server errors in
// words for the person playing. Reads the page state (window.__worldserve); writes only the DOM.

const CODEC_NAMES = { h264: "H.264", jpeg: "JPEG", raw: "raw RGB" };
const STAGES = ["queue", "denoise", "context", "decode", "total", "encode"]; // frames.timings keys
const BANNER_MS = 8000; // how long a non-fatal message stays up

const ERROR_WORDS = {
  bad_message: "The server could not read a message from this page.",
  unknown_type: "The server did not understand a message from this page.",
  invalid_field: "The server turned down a request",
  too_large: "A message from this page was too large for the server.",
  rate_limited: "Too much input at once; the server skipped some of it.",
  busy: "The server is full right now. Try again in a moment.",
  not_found: "That world or session does not exist (a left session expires after about a minute).",
  unauthorized: "This server needs an access token: add ?token=... to the page address.",
  internal: "The server ran into a problem",
};
const CLOSED_WORDS = {
  closed: "The session ended.",
  done: "The run is finished.",
  expired: "The session expired after being left alone too long.",
  error: "The session ended because the server failed.",
  shutdown: "The server is shutting down.",
};

/** A server `error` message in words. */
export function errorText({ code, message, fatal }) {
  const words = ERROR_WORDS[code] ?? `The server reported an error (${code}).`;
  let text = words;
  if (code === "invalid_field" || code === "internal") text += `: ${message}.`;
  else if (message) text += ` The server says: ${message}.`;
  if (code === "internal" && !fatal) text += " The world went back to its last good state.";
  if (fatal) text += " The session has ended; press Start for a new one.";
  return text;
}

/** A `closed` message in words. */
export function closedText(reason) {
  return CLOSED_WORDS[reason] ?? `The session ended (${reason}).`;
}

export class Hud {
  constructor(root, banner) {
    this.root = root;
    this.banner = banner;
    this.bannerUntil = 0;
    this.cells = {};
    for (const el of root.querySelectorAll("[data-k]")) this.cells[el.dataset.k] = el;
  }

  set(key, text, cls = "") {
    const el = this.cells[key];
    if (!el) return;
    if (el.textContent !== text) el.textContent = text;
    el.className = cls;
  }

  /** Show a message over the picture; `sticky` keeps it until the next one. */
  say(text, { level = "error", sticky = false, html = null } = {}) {
    this.banner.hidden = false;
    this.banner.className = level;
    if (html) this.banner.replaceChildren(...html);
    else this.banner.textContent = text;
    this.bannerUntil = sticky ? Infinity : performance.now() + BANNER_MS;
  }

  render(s) {
    if (performance.now() > this.bannerUntil) this.banner.hidden = true;
    const statusText = s.statusDetail ? `${s.status}: ${s.statusDetail}` : s.status;
    this.set("status", statusText, `status-${s.status}`);
    const m = s.modelInfo;
    this.set("model", m ? `${m.id} · ${m.width}×${m.height} @ ${m.fps} fps · ${m.chunk_frames} frames/chunk` : "—");
    this.set("keys", m ? m.action_space.keys.join(" ") + (m.action_space.mouse ? " + mouse" : "") : "—");
    let codec = s.codec ? CODEC_NAMES[s.codec] ?? s.codec : "—";
    if (s.codec === "h264" && s.codecString) codec += ` (${s.codecString}, WebCodecs)`;
    const note = s.fallback ? `fallback: ${s.fallback}` : s.codecProblem;
    this.set("codec", note ? `${codec} — ${note}` : codec, note ? "warn" : "");
    this.set("fps", m ? `${s.fps.toFixed(1)} / ${m.fps}` : s.fps.toFixed(1), m && s.fps < 0.8 * m.fps ? "warn" : "");
    this.set(
      "latency",
      s.latencyMs === null ? "— (press a key)" : `${Math.round(s.latencyMs)} ms (avg ${Math.round(s.latencyAvgMs)} ms)`,
    );
    this.set("rtt", s.rttMs === null ? "—" : `${s.rttMs.toFixed(1)} ms`);
    this.set("queue", `${s.queueFrames} frames in ${s.queueChunks} chunks`);
    this.set("chunk", `#${s.chunk} shown, #${s.chunkReceived} received, world ${s.worlds}`);
    this.set(
      "actions",
      s.lastActionSeq ? `sent #${s.lastActionSeq}, on screen #${s.lastAppliedSeq ?? "—"}` : "none yet",
    );
    const t = s.timings;
    this.set("timings", STAGES.filter((k) => k in t).map((k) => `${k} ${Number(t[k]).toFixed(1)}`).join(" · ") || "—");
    this.set("counts", `${s.chunksShown} chunks · ${s.framesShown} frames · ${s.gaps} missed · ${s.reconnects} reconnects`);
    this.set("session", s.sessionId ? s.sessionId : "—");
  }
}
