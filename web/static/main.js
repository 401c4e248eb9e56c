// The worldserve page: controls, HUD refresh and boot around a Stream (stream.js).
// URL parameters: model, seed, codec (h264|jpeg|raw), autostart=1, resume=TOKEN, ahead (max_ahead),
// token (a server token), image (a same-origin start image URL for image-started worlds),
// prompt (the text of a text world).
// window.__worldserve holds the page state, kept current, for automation.

import { Hud } from "./hud.js";
import { Input } from "./input.js";
import { Player } from "./player.js";
import { CODECS } from "./protocol.js";
import { fetchStartImage, readStartImage, StartImageError } from "./startimage.js";
import { Stream } from "./stream.js";

const ACTION_INTERVAL_MS = 50; // actions repeat at this period while keys are held or the mouse moves
const HUD_MS = 250; // HUD refresh period
// Chunks the server may generate past the last one shown. 1 gives the lowest latency (about
// 1.5 chunks: half a chunk until the next chunk boundary, plus the chunk playing now); 2 hides
// more jitter at one chunk more latency (?ahead=2).
const DEFAULT_AHEAD = 1;

const $ = (id) => document.getElementById(id);
const url = new URLSearchParams(location.search);

const state = (window.__worldserve = {
  status: "idle", // idle | connecting | playing | paused | reconnecting | closed | failed
  statusDetail: "",
  chunksShown: 0, // chunks whose first frame was shown (cumulative over the page's life)
  framesShown: 0,
  fps: 0, // frames shown over the last second
  lastActionSeq: 0, // seq of the last `action` sent
  lastAppliedSeq: null, // frames.action_seq of the last chunk shown
  codec: null, // the codec in use: h264 | jpeg | raw
  codecString: null, // WebCodecs codec string (H.264)
  fallback: null, // why JPEG is used instead of the H.264 asked for, or null
  codecProblem: null, // why the page address's ?codec= was not used, or null
  errors: [], // server errors: {code, message, fatal, seq, text}
  model: null, // model id
  modelInfo: null, // ready.model
  sessionId: null,
  resumeToken: null,
  chunk: 0, // last chunk shown
  chunkReceived: 0, // last chunk received
  worlds: 0, // worlds in this session (1 + resets)
  reconnects: 0, // successful resumes after a dropped socket
  gaps: 0, // chunks that never arrived (dropped by the server for a slow reader)
  latencyMs: null, // last action-to-frame latency: input change -> first frame applying it
  latencyAvgMs: null,
  rttMs: null, // ping round trip
  queueFrames: 0, // frames in the jitter buffer
  queueChunks: 0,
  timings: {}, // frames.timings of the last chunk received (ms per stage)
  paused: false,
  skipped: 0, // frames that could not be decoded (or waited too long for the decoder)
  stillsShown: 0, // ready.frame pictures drawn (the world before its first chunk)
  cancels: 0, // `cancelled` replies
  rewinds: 0, // `ready`s answering ⟲ back
  rewoundTo: null, // the chunk the last of them named
  mouseSent: 0, // |dx| + |dy| sent in actions, px
  forks: [], // resume tokens of forks made here
  startImage: null, // {name, width, height} of the start image sent with the last open, or null
  imageProblem: null, // why the start image could not be used, or null
  prompt: null, // the prompt in force (text worlds): sent with open / reset, or switched to; or null
  promptSwitches: 0, // `prompt` switches that took effect (their first chunk arrived)
});
const models = new Map(); // model id -> its /v1/models entry

const canvas = $("screen");
const hud = new Hud($("hud"), $("banner"));
const player = new Player(canvas);
const input = new Input(canvas, () => stream.sendAction(true));
const stream = new Stream({ state, player, input, hud, onReady, onStatus });

function onReady(msg) {
  canvas.style.aspectRatio = `${msg.model.width} / ${msg.model.height}`;
  if ($("model").value !== msg.model.id) selectModel(msg.model.id);
  showPickers();
  if (msg.codec.name !== $("codec").value && !state.fallback) $("codec").value = msg.codec.name;
  $("mouse-help").hidden = !msg.model.action_space.mouse; // keyboard-only worlds: no pointer lock
}

function onStatus(status) {
  const live = status === "playing" || status === "paused";
  for (const id of ["pause", "cancel", "back", "reset", "fork"]) $(id).disabled = !live;
  $("pause").textContent = state.paused ? "Resume" : "Pause";
  hud.render(state);
}

async function start() {
  const model = $("model").value || undefined;
  let image;
  try {
    image = await startImage(models.get(model));
  } catch (err) {
    if (!(err instanceof StartImageError)) throw err;
    state.imageProblem = err.message;
    hud.say(err.message, { sticky: true });
    hud.render(state);
    return; // nothing is sent: the person picks another file
  }
  $("overlay").hidden = true;
  player.start();
  state.prompt = typedPrompt(models.get(model));
  stream.open({
    model,
    seed: parseSeed($("seed").value),
    codec: $("codec").value,
    maxAhead: parseInt(url.get("ahead"), 10) || DEFAULT_AHEAD,
    token: url.get("token") || undefined,
    image,
    prompt: state.prompt ?? undefined,
  });
}

/** The prompt box's text for a text world (its /v1/models entry has `prompts`), else null. */
function typedPrompt(world) {
  const text = $("prompt").value.trim();
  return world?.prompts && text ? text : null;
}

/** A fresh world with the seed above and, for a text world, the prompt typed (none: the same). */
function reset() {
  const prompt = typedPrompt(models.get(state.model ?? $("model").value));
  if (prompt) state.prompt = prompt;
  stream.reset(parseSeed($("seed").value), prompt ?? undefined);
}

/** The `open.image` for `world` (its /v1/models entry): the picked file, else ?image=, else none. */
async function startImage(world) {
  state.imageProblem = null;
  state.startImage = null;
  if (!world?.image_start) return undefined; // other worlds refuse a start image
  const file = $("start-image").files[0];
  const source = file ?? (url.get("image") ? await fetchStartImage(url.get("image"), location) : null);
  if (!source) return undefined; // the world's own start image, if it has one
  const image = await readStartImage(source, world);
  const [height, width] = image.shape;
  state.startImage = { name: file?.name ?? url.get("image"), width, height };
  return image;
}

/** Show the start-image picker only for worlds that start from an image, the prompt box only
 * for worlds that take text. */
function showPickers() {
  const world = models.get($("model").value);
  $("image-picker").hidden = !world?.image_start;
  $("prompt-box").hidden = !world?.prompts;
}

// actions repeat while keys are held or the mouse moves; the gamepad is polled here too
setInterval(() => {
  input.pollGamepad();
  if (input.keys().length || input.moved) stream.sendAction(false);
}, ACTION_INTERVAL_MS);

// -- controls -----------------------------------------------------------------------------------

function parseSeed(text) {
  const seed = Number(text);
  return text.trim() !== "" && Number.isSafeInteger(seed) && seed >= 0 ? seed : undefined;
}

function selectModel(id) {
  const select = $("model");
  if (![...select.options].some((o) => o.value === id)) select.add(new Option(id, id));
  select.value = id;
}

function button(id, fn) {
  $(id).addEventListener("click", (e) => {
    e.currentTarget.blur(); // Space is a game key: keep it away from focused buttons
    fn();
  });
}

button("start", start);
button("overlay", start);
button("pause", () => stream.pause(!state.paused));
button("cancel", () => stream.cancel());
button("reset", reset);
// ⟲ back: one chunk back per press; held, it keeps stepping back (generation paused meanwhile)
$("back").addEventListener("pointerdown", (e) => {
  e.currentTarget.setPointerCapture(e.pointerId);
  stream.scrub(true);
});
for (const type of ["pointerup", "pointercancel"]) {
  $("back").addEventListener(type, (e) => {
    e.currentTarget.blur(); // Space is a game key: keep it away from focused buttons
    stream.scrub(false);
  });
}
button("fork", () => stream.fork(window.open("about:blank", "_blank"))); // opened while the click counts
button("dice", () => {
  $("seed").value = String(Math.floor(Math.random() * 2 ** 31));
});
$("model").addEventListener("change", (e) => {
  e.target.blur();
  showPickers();
  if (stream.live) start();
});
$("start-image").addEventListener("change", (e) => {
  e.target.blur();
  if (stream.live) start(); // reset keeps the session's image: a new picture needs a new session
});
// Enter: start the world, or switch a running one to the prompt typed (it goes on from where it
// is); Shift+Enter (or Reset): a fresh world with it.
$("prompt").addEventListener("keydown", (e) => {
  if (e.key !== "Enter") return;
  e.preventDefault();
  e.target.blur(); // back to the game keys
  if (!stream.live) start();
  else if (e.shiftKey) reset();
  else {
    const prompt = typedPrompt(models.get(state.model ?? $("model").value));
    if (prompt) stream.switchPrompt(prompt);
  }
});
$("codec").addEventListener("change", (e) => {
  e.target.blur();
  state.codecProblem = null; // a codec picked by hand replaces the address's
  stream.switchCodec(e.target.value);
});
window.addEventListener("pagehide", () => stream.close());

setInterval(() => {
  Object.assign(state, {
    fps: player.fps,
    queueFrames: player.bufferedFrames,
    queueChunks: player.bufferedChunks,
    framesShown: player.framesShown,
    chunksShown: player.chunksShown,
    skipped: player.skipped,
  });
  hud.render(state);
}, HUD_MS);

// -- boot ---------------------------------------------------------------------------------------

async function boot() {
  let codec = url.get("codec");
  if (codec !== null && !CODECS.includes(codec)) {
    state.codecProblem = `?codec=${codec} is not one of ${CODECS.join(", ")}; using ${$("codec").value}`;
    const words = `The page address asks for codec "${codec}", which this page does not know`;
    hud.say(`${words} (${CODECS.join(", ")}); using ${$("codec").value} instead.`, { level: "warn", sticky: true });
    codec = null;
  }
  if (codec) $("codec").value = codec;
  if (url.has("seed")) $("seed").value = url.get("seed");
  if (url.has("prompt")) $("prompt").value = url.get("prompt");
  try {
    const res = await fetch("/v1/models");
    for (const m of await res.json()) {
      const option = new Option(`${m.id}${m.default ? " (default)" : ""}`, m.id, m.default, m.default);
      option.title = m.description ?? "";
      $("model").add(option);
      models.set(m.id, m);
    }
  } catch (err) {
    hud.say(`Could not list the worlds (${err.message}); is the server up?`, { sticky: true });
  }
  if (url.get("model")) selectModel(url.get("model"));
  showPickers();
  hud.render(state);
  if (url.get("resume")) {
    player.start();
    stream.attach(url.get("resume"), codec);
  } else if (url.get("autostart") === "1") start();
  else $("overlay").hidden = false;
}

boot();
