// Playback at the model's fps from a small jitter buffer of decoded chunks.
//
// Each `frames` message becomes a Slot of `count` frames that the decoder fills (in any order,
// asynchronously). The player shows frames strictly in order, one every 1000/fps ms. When the
// buffer runs dry it waits (holding the last picture) until JITTER_CHUNKS chunks are buffered
// again, or the oldest one has waited MAX_WAIT_MS, so that network and generation jitter costs
// one pause rather than a stutter on every chunk. `onChunkShown(slot)` fires when a chunk's
// first frame is on screen (the caller acks it there).

const JITTER_CHUNKS = 1; // chunks buffered before playback (re)starts after running dry
const MAX_WAIT_MS = 150; // ... or how long the oldest buffered chunk may wait for that
const FPS_WINDOW_MS = 1000; // the fps figure counts frames shown over this window
const DECODE_TIMEOUT_MS = 2000; // a frame not decoded this long after its chunk arrived is skipped

export class Slot {
  constructor(meta, count) {
    this.meta = meta; // the `frames` message fields other than data, plus recvAt (ms)
    this.frames = new Array(count).fill(undefined); // ImageBitmap | null (skipped) | undefined (pending)
    this.next = 0; // index of the next frame to show
    this.dropped = false; // flushed: late decoder outputs are closed, not stored
  }

  put(i, bitmap) {
    if (this.dropped || i < this.next) bitmap.close(); // flushed, or given up on (too late)
    else this.frames[i] = bitmap;
  }

  skip(i) {
    if (!this.dropped && this.frames[i] === undefined) this.frames[i] = null;
  }

  get left() {
    return this.frames.length - this.next;
  }

  drop() {
    this.dropped = true;
    for (const f of this.frames) f?.close?.();
    this.frames.fill(null);
  }
}

export class Player {
  constructor(canvas, { onChunkShown, onFrameShown } = {}) {
    this.canvas = canvas;
    this.ctx = canvas.getContext("2d", { alpha: false });
    this.onChunkShown = onChunkShown;
    this.onFrameShown = onFrameShown;
    this.slots = []; // buffered chunks, oldest first
    this.interval = 1000 / 15; // ms per frame
    this.due = null; // when the next frame is due (performance.now() ms); null while buffering
    this.held = false; // paused: keep the picture, keep the buffer
    this.shownTimes = []; // performance.now() of recent frames, for fps
    this.framesShown = 0;
    this.chunksShown = 0;
    this.skipped = 0; // frames that could not be decoded
    this.raf = null;
  }

  setModel({ fps, width, height }) {
    this.interval = 1000 / fps;
    if (this.canvas.width !== width || this.canvas.height !== height) {
      this.canvas.width = width;
      this.canvas.height = height;
      this.ctx.fillStyle = "#000";
      this.ctx.fillRect(0, 0, width, height);
    }
  }

  /** Show one picture now (ready.frame: the world before its first chunk), outside the buffer. */
  drawStill(bitmap) {
    this.ctx.drawImage(bitmap, 0, 0, this.canvas.width, this.canvas.height);
    bitmap.close();
  }

  add(meta, count) {
    const slot = new Slot(meta, count);
    this.slots.push(slot);
    return slot;
  }

  /** Drop buffered chunks (all, or those with chunk <= upTo). */
  flush(upTo = Infinity) {
    const keep = [];
    for (const s of this.slots) {
      if (s.meta.chunk <= upTo) s.drop();
      else keep.push(s);
    }
    this.slots = keep;
    if (!keep.length) this.due = null;
  }

  get bufferedFrames() {
    return this.slots.reduce((n, s) => n + s.left, 0);
  }

  get bufferedChunks() {
    return this.slots.length;
  }

  get fps() {
    const now = performance.now();
    while (this.shownTimes.length && now - this.shownTimes[0] > FPS_WINDOW_MS) this.shownTimes.shift();
    return (this.shownTimes.length * 1000) / FPS_WINDOW_MS;
  }

  start() {
    const loop = (now) => {
      this.tick(now);
      this.raf = requestAnimationFrame(loop);
    };
    if (this.raf === null) this.raf = requestAnimationFrame(loop);
  }

  stop() {
    if (this.raf !== null) cancelAnimationFrame(this.raf);
    this.raf = null;
  }

  tick(now) {
    if (this.held) {
      this.due = null;
      return;
    }
    if (this.due === null) {
      const oldest = this.slots[0];
      if (!oldest) return;
      const ready = this.slots.length >= JITTER_CHUNKS || now - oldest.meta.recvAt >= MAX_WAIT_MS;
      if (!ready) return;
      this.due = now;
    }
    if (now - this.due > 4 * this.interval) this.due = now; // came back from a stall: no burst
    while (now >= this.due) {
      const shown = this.step(now);
      if (shown === "empty") {
        this.due = null; // ran dry: buffer again
        return;
      }
      if (shown === "wait") return; // the next frame is still decoding
      if (shown === "shown") this.due += this.interval;
    }
  }

  // Show the next frame: "shown", "skipped" (undecodable, no time spent), "wait" or "empty".
  step(now) {
    const slot = this.slots[0];
    if (!slot) return "empty";
    const i = slot.next;
    let frame = slot.frames[i];
    if (frame === undefined) {
      if (now - slot.meta.recvAt < DECODE_TIMEOUT_MS) return "wait";
      frame = null; // the decoder never delivered it
    }
    slot.next++;
    if (slot.next >= slot.frames.length) this.slots.shift();
    if (i === 0) {
      this.chunksShown++;
      this.onChunkShown?.(slot);
    }
    if (frame === null) {
      this.skipped++;
      return "skipped";
    }
    slot.frames[i] = null;
    this.ctx.drawImage(frame, 0, 0, this.canvas.width, this.canvas.height);
    frame.close();
    this.framesShown++;
    this.shownTimes.push(now);
    this.onFrameShown?.(slot);
    return "shown";
  }
}
