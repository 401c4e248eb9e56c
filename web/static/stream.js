// A session's stream: server messages -> decoder -> player, and the client's side of the flow
// control. Chunks are deduplicated by number (a resume re-sends what was not acked), acked when
// their first frame is on screen, and timed against the input that reached them (latency).
// `ready.frame` (the world's latest frame, e.g. an image-started world's start frame) is drawn at
// once for a new session or a reset, unless a chunk's frame got on screen first.
// H.264 falls back to JPEG (by resuming the session with ?codec=jpeg) when it cannot decode.
// ⟲ back (`scrub`): `rewind` one chunk behind the one on screen, then, while held, one more
// after each answering `ready` (SCRUB_MS apart), with realtime generation paused meanwhile.

import { decodeStill, h264Problem, makeDecoder } from "./decoders.js";
import { closedText, errorText } from "./hud.js";
import { client } from "./protocol.js";
import { SessionSocket } from "./session.js";

const MAX_ERRORS = 50; // errors kept in state.errors
const LATENCY_SAMPLES = 20; // the latency average is over this many samples
const H264_RETRIES = 2; // decoder failures (after frames did decode) before falling back to JPEG
const SCRUB_MS = 200; // a held ⟲ back steps one chunk back this often at most

export class Stream {
  constructor({ state, player, input, hud, onReady, onStatus }) {
    this.state = state; // window.__worldserve (written here)
    this.player = player;
    this.input = input;
    this.hud = hud;
    this.onReadyHook = onReady; // (ready message) after each `ready`
    this.onStatusHook = onStatus; // (status) after each status change
    this.conn = new SessionSocket({
      onMessage: (msg, socket) => this.receive(msg, socket),
      onStatus: (status, detail) => this.status(status, detail),
      onProblem: (text) => hud.say(text),
    });
    this.decoder = null;
    this.forkTab = null; // the tab opened for a fork, waiting for `forked`
    this.pendingPrompt = null; // {seq, text} of a `prompt` switch not yet in a chunk
    this.stillGen = 0; // counts ready frames: a slow decode of an older one is not drawn
    this.held = false; // ⟲ back is held down
    this.rewinding = null; // the chunk of the `rewind` sent and not answered yet
    this.pausedForScrub = false; // generation was paused by the scrub (resumed on release)
    player.onChunkShown = (slot) => this.shown(slot);
    this.clear();
  }

  clear() {
    this.readySocket = 0; // the socket the last `ready` came on
    this.lastReceived = 0; // highest chunk received (dedupe)
    this.lastAck = 0; // highest chunk acked
    this.changes = []; // input changes not yet on screen: {seq, t}
    this.latencies = [];
    this.h264Failures = 0;
    this.wasReconnecting = false;
    this.player.flush();
    this.player.held = false;
    Object.assign(this.state, { sessionId: null, resumeToken: null, paused: false, worlds: 0, chunk: 0 });
  }

  get live() {
    return this.conn.live;
  }

  // -- commands ---------------------------------------------------------------------------------

  /** A new session; `params` as client.open takes them. */
  async open(params) {
    const codec = await this.usableCodec(params.codec);
    this.conn.close(true);
    this.clear();
    this.conn.open({ ...params, codec });
  }

  /** Attach to a live session by its resume token (a fork, a link). */
  async attach(token, codec) {
    const usable = codec ? await this.usableCodec(codec) : null;
    this.conn.close(true);
    this.clear();
    this.conn.attach(token, usable);
  }

  /** Go on with the same session in another codec (a resume with ?codec=). */
  async switchCodec(codec) {
    const usable = await this.usableCodec(codec);
    if (this.live) this.conn.attach(this.conn.token, usable);
  }

  sendAction(change) {
    if (!this.live) return;
    const seq = this.conn.nextSeq();
    const now = performance.now();
    const mouse = this.input.takeMouse();
    this.conn.send(client.action(seq, this.input.keys(), mouse, performance.timeOrigin + now));
    this.state.lastActionSeq = seq;
    this.state.mouseSent += Math.abs(mouse[0]) + Math.abs(mouse[1]);
    if (change) this.changes = [...this.changes.slice(-63), { seq, t: now }];
  }

  pause(on) {
    this.state.paused = on;
    this.player.held = on; // keep the picture and the buffer while paused
    this.conn.pause(on);
  }

  cancel() {
    this.conn.send(client.cancel(this.conn.nextSeq()));
  }

  reset(seed, prompt) {
    this.pendingPrompt = null; // a new world starts from its own prompt
    this.conn.send(client.reset(this.conn.nextSeq(), seed, prompt));
  }

  /** ⟲ back pressed (`down`) or released: rewind chunk by chunk while it is held. */
  scrub(down) {
    this.held = down;
    if (down && !this.state.paused) {
      this.pausedForScrub = true;
      this.conn.pause(true);
    }
    if (down) this.stepBack();
    else if (this.pausedForScrub && this.rewinding === null) this.endScrub();
  }

  stepBack() {
    if (!this.live || this.rewinding !== null) return;
    const target = Math.max(0, (this.state.chunk || 0) - 1);
    if (target === this.state.chunk) return this.endScrub(); // nothing before the world's start
    this.rewinding = target;
    this.conn.send(client.rewind(this.conn.nextSeq(), target));
  }

  endScrub() {
    this.held = false;
    if (this.pausedForScrub) this.conn.pause(false);
    this.pausedForScrub = false;
  }

  /** Switch a text world's prompt, keeping the world: the next chunk is generated under it (the
   * first chunk's `frames.prompt_seq` names it; state.prompt follows then). */
  switchPrompt(text) {
    const seq = this.conn.nextSeq();
    this.pendingPrompt = { seq, text };
    this.conn.send(client.prompt(seq, text));
  }

  /** Fork; `tab` (opened during the click, so no popup blocker stops it) gets the copy. */
  fork(tab) {
    this.forkTab = tab;
    this.conn.send(client.fork(this.conn.nextSeq()));
  }

  close() {
    this.conn.close(true);
  }

  // -- codec choice -----------------------------------------------------------------------------

  /** `codec`, or JPEG when it is H.264 and this browser cannot decode it (state.fallback says why). */
  async usableCodec(codec) {
    this.state.fallback = null;
    if (codec !== "h264") return codec;
    const problem = await h264Problem();
    if (!problem) return codec;
    this.fallBack(problem);
    return "jpeg";
  }

  fallBack(reason) {
    this.state.fallback = reason;
    this.hud.say(`H.264 is not available here (${reason}); showing JPEG instead.`, { level: "warn" });
  }

  useCodec(info) {
    this.state.codec = info.name;
    this.state.codecString = info.codec ?? null;
    const dec = this.decoder;
    if (dec && dec.name === info.name && (dec.codec ?? null) === (info.codec ?? null)) {
      dec.reset(); // a new socket: H.264 restarts at an IDR
      dec.dead = false;
      return;
    }
    dec?.close();
    this.decoder = null;
    try {
      const fresh = makeDecoder(info, (err, decodedAny) => this.decoderFailed(fresh, err, decodedAny));
      this.decoder = fresh;
    } catch (err) {
      this.fallBack(`the H.264 decoder could not start: ${err.message}`); // only H.264 can throw
      this.conn.attach(this.conn.token, "jpeg");
    }
  }

  decoderFailed(dec, err, decodedAny) {
    if (dec !== this.decoder || dec.dead) return; // an old decoder, or already handled
    dec.dead = true;
    this.h264Failures++;
    if (!decodedAny || this.h264Failures > H264_RETRIES) {
      this.fallBack(`H.264 decoding failed: ${err.message}`);
      this.conn.attach(this.conn.token, "jpeg");
    } else {
      this.conn.attach(this.conn.token); // a new socket starts with a keyframe
    }
  }

  // -- server messages --------------------------------------------------------------------------

  receive(msg, socket) {
    const { state, hud } = this;
    switch (msg.type) {
      case "ready": return this.ready(msg, socket);
      case "frames": return this.frames(msg);
      case "forked": return this.forked(msg);
      case "pong": state.rttMs = this.conn.rttMs; return;
      case "error": {
        if (msg.code === "not_retained") {
          this.rewinding = null;
          this.endScrub();
          hud.say("The server keeps no older chunk of this world.", { level: "info" });
          return;
        }
        const refused = this.conn.refusal === msg; // our `open` was turned down: the attempt ended
        const text = errorText(refused ? { ...msg, fatal: true } : msg);
        state.errors = [...state.errors.slice(1 - MAX_ERRORS), { ...msg, text }];
        hud.say(text, { sticky: Boolean(msg.fatal || refused) });
        return;
      }
      case "cancelled":
        state.cancels++;
        if (this.rewinding !== null) return; // a rewind cancels what was in flight: no news
        if (msg.prompt_seq !== undefined && msg.prompt_seq === this.pendingPrompt?.seq) {
          this.pendingPrompt = null;
          hud.say(`Chunk ${msg.chunk} was cancelled, and the prompt switch with it; the world is as it was.`, { level: "info" });
          return;
        }
        hud.say(`Chunk ${msg.chunk} was cancelled; the world is as it was.`, { level: "info" });
        return;
      case "prompted":
        hud.say("New prompt: the next chunk follows it.", { level: "info" });
        return;
      case "closed":
        hud.say(closedText(msg.reason), { level: msg.reason === "closed" ? "info" : "error", sticky: true });
        return;
      default: // `done` belongs to one-shot runs; newer message types are ignored
    }
  }

  ready(msg, socket) {
    const { state, player } = this;
    const same = msg.session_id === state.sessionId;
    const fresh = socket === this.readySocket || !same; // a reset or another session: a new picture
    if (socket === this.readySocket && this.rewinding !== null) {
      // the answer to ⟲ back: chunk msg.chunk is the world's last; its numbers after it come again
      player.flush();
      this.lastReceived = state.chunk = state.rewoundTo = msg.chunk;
      this.lastAck = Math.min(this.lastAck, msg.chunk);
      this.rewinding = null;
      state.rewinds++;
      this.hud.say(`Back to chunk ${msg.chunk}.`, { level: "info" });
      if (this.held) setTimeout(() => this.held && this.stepBack(), SCRUB_MS);
      else if (this.pausedForScrub) this.endScrub();
    } else if (socket === this.readySocket) {
      // a second `ready` on one socket answers `reset`: chunks after msg.chunk are the new world
      player.flush(msg.chunk);
      this.lastReceived = Math.max(this.lastReceived, msg.chunk);
      state.worlds++;
      this.hud.say("A new world.", { level: "info" });
    } else {
      this.readySocket = socket;
      if (!same) {
        player.flush();
        this.lastReceived = this.lastAck = 0;
        state.worlds = 1;
      } else if (this.wasReconnecting) {
        state.reconnects++;
        this.hud.say("Reconnected.", { level: "info" });
      }
      this.wasReconnecting = false;
      this.useCodec(msg.codec);
      // ack again what was shown: the last ack may have been lost with the socket, and a chunk
      // shown while no socket was open was never acked (its re-sent copy is dropped as a duplicate)
      const shown = Math.max(this.lastAck, state.chunk);
      if (same && shown && this.conn.send(client.ack(shown))) this.lastAck = shown;
    }
    Object.assign(state, { sessionId: msg.session_id, resumeToken: msg.resume_token, model: msg.model.id });
    if (JSON.stringify(state.modelInfo) !== JSON.stringify(msg.model)) {
      state.modelInfo = msg.model;
      player.setModel(msg.model);
      this.input.setActionSpace(msg.model.action_space);
    }
    if (fresh && msg.frame !== undefined) this.showStill(msg.frame);
    this.onReadyHook?.(msg);
    if (this.input.keys().length) this.sendAction(true); // keys held across a reset or a reconnect
  }

  /** Draw `ready.frame` once decoded, unless a newer ready or a chunk's frame came first. */
  showStill(frame) {
    const gen = ++this.stillGen;
    const shown = this.player.framesShown;
    decodeStill(frame).then(
      (bitmap) => {
        if (gen !== this.stillGen || this.player.framesShown !== shown) return bitmap.close();
        this.player.drawStill(bitmap);
        this.state.stillsShown++;
      },
      () => this.player.skipped++, // counted with the frames that could not be decoded
    );
  }

  frames(msg) {
    const { state } = this;
    if (msg.chunk <= this.lastReceived) {
      // re-sent after a reconnect and already here; H.264 still needs it as a reference
      if (this.decoder?.name === "h264" && msg.codec === "h264") this.decoder.decode(msg, null);
      return;
    }
    if (this.lastReceived && msg.chunk > this.lastReceived + 1) state.gaps += msg.chunk - this.lastReceived - 1;
    this.lastReceived = state.chunkReceived = msg.chunk;
    state.timings = msg.timings;
    if (msg.prompt_seq !== undefined && msg.prompt_seq === this.pendingPrompt?.seq) {
      state.prompt = this.pendingPrompt.text; // the first chunk under the new prompt
      state.promptSwitches++;
      this.pendingPrompt = null;
    }
    if (!this.decoder || this.decoder.name !== msg.codec) return;
    const meta = { chunk: msg.chunk, frame0: msg.frame0, actionSeq: msg.action_seq ?? null, recvAt: performance.now() };
    this.decoder.decode(msg, this.player.add(meta, msg.count));
  }

  /** A chunk's first frame is on screen: ack it (flow control) and time the input it applied. */
  shown(slot) {
    const { state } = this;
    const { chunk, actionSeq } = slot.meta;
    state.chunk = chunk;
    state.chunksShown = this.player.chunksShown;
    if (chunk > this.lastAck && this.conn.send(client.ack(chunk))) this.lastAck = chunk;
    if (actionSeq === null) return;
    state.lastAppliedSeq = actionSeq;
    const now = performance.now();
    while (this.changes.length && this.changes[0].seq <= actionSeq) {
      const ms = now - this.changes.shift().t;
      this.latencies = [...this.latencies.slice(1 - LATENCY_SAMPLES), ms];
      state.latencyMs = ms;
      state.latencyAvgMs = this.latencies.reduce((a, b) => a + b, 0) / this.latencies.length;
    }
  }

  forked(msg) {
    this.state.forks.push(msg.resume_token);
    const link = `/?resume=${encodeURIComponent(msg.resume_token)}&codec=${this.state.codec}`;
    const tab = this.forkTab;
    this.forkTab = null;
    if (tab && !tab.closed) {
      tab.location.href = link;
      this.hud.say("Forked: the copy plays in a new tab.", { level: "info" });
    } else {
      const a = Object.assign(document.createElement("a"), { href: link, target: "_blank", textContent: "open it" });
      this.hud.say("", { level: "info", html: ["Forked the world: ", a, "."] });
    }
  }

  status(status, detail) {
    this.state.status = status;
    this.state.statusDetail = detail;
    if (status === "reconnecting") this.wasReconnecting = true;
    // a refused `open` is on the banner already, in the error's own words
    if (status === "failed" && detail && !this.conn.refusal) this.hud.say(`Disconnected: ${detail}.`, { sticky: true });
    if (status === "closed" || status === "failed") this.player.held = false;
    this.onStatusHook?.(status);
  }
}
