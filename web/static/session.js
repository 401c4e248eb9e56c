// One session over a websocket, kept alive across dropped sockets.
//
// Status: idle -> connecting -> playing <-> paused; a dropped socket -> reconnecting -> playing
// (attached again with ?resume=TOKEN: the server answers `ready` and re-sends the chunks not yet
// acked); the server's `closed`, a fatal `error` or our own `close` -> closed; giving up -> failed.
// Messages are handed to `onMessage(msg, socket)`, where `socket` counts the sockets so far, so
// the caller can tell a resume's `ready` (first on a socket) from a reset's (a later one).
// An `error` before the first `ready` is a refused `open` (unknown model, bad field, full server):
// the attempt ends there, `refusal` holds that error, and the status says it in words.

import { errorText } from "./hud.js";
import { client, pack, parse, ProtocolError, sessionUrl } from "./protocol.js";

const RETRY_MS = [200, 500, 1000, 2000, 3000]; // waits between reconnect attempts (then the last)
const GIVE_UP_MS = 60_000; // the server's default detach TTL: after it the session is gone
const PING_MS = 5000; // round-trip probe period

export class SessionSocket {
  constructor({ onMessage, onStatus, onProblem }) {
    this.onMessage = onMessage;
    this.onStatus = onStatus; // (status, detail)
    this.onProblem = onProblem; // (text): something for the person playing to read
    this.status = "idle";
    this.ws = null;
    this.socket = 0; // sockets opened so far
    this.seq = 0; // last seq used (one counter for every message that carries a seq)
    this.token = null; // resume token, once `ready` came
    this.codec = null; // the codec this session uses (a resume asks for it again)
    this.paused = false;
    this.ended = false; // the session is over: never reconnect
    this.refusal = null; // the `error` that refused our `open`, if one did
    this.reached = false; // the current socket opened (the server was reached)
    this.lostAt = null; // when the socket dropped (performance.now())
    this.attempt = 0;
    this.rttMs = null;
    this.timer = null;
    this.pinger = null;
  }

  nextSeq() {
    return ++this.seq;
  }

  get live() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN && this.token !== null;
  }

  setStatus(status, detail = "") {
    this.status = status;
    this.onStatus?.(status, detail);
  }

  /** Open a new session. */
  open(params) {
    this.token = null;
    this.ended = false;
    this.refusal = null;
    this.paused = false;
    this.codec = params.codec;
    this.dial(sessionUrl(location), client.open(params));
  }

  /** Attach to a live session (a fork, a link, or a reconnect), optionally with another codec. */
  attach(token, codec) {
    this.token = token;
    this.ended = false;
    this.refusal = null;
    if (codec) this.codec = codec;
    this.dial(sessionUrl(location, { resume: token, codec: this.codec }), null);
  }

  dial(url, first) {
    clearTimeout(this.timer);
    const ws = new WebSocket(url);
    ws.binaryType = "arraybuffer";
    const socket = ++this.socket;
    const previous = this.ws;
    this.ws = ws; // from here on, events of older sockets are ignored
    if (previous && previous.readyState <= WebSocket.OPEN) previous.close(1000, "replaced");
    if (this.status !== "reconnecting") this.setStatus("connecting");
    this.reached = false;
    ws.onopen = () => {
      if (ws !== this.ws) return;
      this.reached = true;
      if (first) ws.send(pack(first));
    };
    ws.onmessage = (e) => {
      if (ws !== this.ws) return;
      if (!(e.data instanceof ArrayBuffer)) return this.onProblem?.("The server sent a text frame; ignored.");
      let msg;
      try {
        msg = parse(e.data);
      } catch (err) {
        if (err instanceof ProtocolError) return this.onProblem?.(`Unreadable message from the server: ${err.message}`);
        throw err;
      }
      this.receive(msg, socket);
    };
    ws.onclose = (e) => {
      if (ws !== this.ws) return;
      this.ws = null;
      clearInterval(this.pinger);
      this.lost(e);
    };
  }

  receive(msg, socket) {
    if (msg.type === "ready") {
      this.token = msg.resume_token;
      this.codec = msg.codec?.name ?? this.codec;
      this.attempt = 0;
      this.lostAt = null;
      this.setStatus(this.paused ? "paused" : "playing");
      clearInterval(this.pinger);
      this.pinger = setInterval(() => this.send(client.ping(performance.now())), PING_MS);
      this.send(client.ping(performance.now()));
    } else if (msg.type === "pong") {
      this.rttMs = performance.now() - msg.t;
    } else if (msg.type === "closed") {
      this.ended = true;
    } else if (msg.type === "error" && !this.token) {
      this.ended = true; // our `open` was refused: this attempt is over
      this.refusal = msg;
    } else if (msg.type === "error" && msg.fatal) {
      this.ended = true;
    }
    this.onMessage(msg, socket);
    // a non-fatal refusal (e.g. invalid_field) leaves the socket open: nothing more will come on it
    if (this.refusal === msg && !msg.fatal) this.ws?.close(1000, "open refused");
  }

  lost(e) {
    if (this.ended || !this.token) {
      this.ended = true;
      if (this.refusal) {
        this.setStatus("failed", errorText({ ...this.refusal, fatal: false }));
      } else if (this.token) {
        this.setStatus("closed");
      } else {
        const why = this.reached
          ? `the server closed the connection before the session started (code ${e.code})`
          : `could not reach the server (websocket closed, code ${e.code})`;
        this.setStatus(e.wasClean ? "closed" : "failed", why);
      }
      return;
    }
    this.lostAt ??= performance.now();
    if (performance.now() - this.lostAt > GIVE_UP_MS) {
      this.ended = true;
      this.setStatus("failed", "the connection did not come back; the session has expired");
      return;
    }
    const wait = RETRY_MS[Math.min(this.attempt++, RETRY_MS.length - 1)];
    this.setStatus("reconnecting", `connection lost; retrying in ${wait} ms`);
    this.timer = setTimeout(() => this.attach(this.token), wait);
  }

  send(msg) {
    if (!this.live) return false;
    this.ws.send(pack(msg));
    return true;
  }

  pause(on) {
    this.paused = on;
    this.send(on ? client.pause(this.nextSeq()) : client.resume(this.nextSeq()));
    if (this.status === "playing" || this.status === "paused") this.setStatus(on ? "paused" : "playing");
  }

  /** End the session (the server answers `closed`); `quiet` skips the status change. */
  close(quiet = false) {
    clearTimeout(this.timer);
    clearInterval(this.pinger);
    this.ended = true;
    const ws = this.ws;
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(pack(client.close()));
    else ws?.close(1000);
    if (quiet) this.ws = null; // a new session follows: ignore this socket from now on
    else if (!ws) this.setStatus("closed");
  }
}
