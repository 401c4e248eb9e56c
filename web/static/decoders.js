// Frame decoders: one `frames` message in, one ImageBitmap per frame out, in order, into the
// player's chunk slot (slot.put(i, bitmap) / slot.skip(i)). H.264 uses WebCodecs' VideoDecoder
// on Annex-B access units (no `description`: SPS/PPS come in-band before every IDR), configured
// with ready.codec.codec; JPEG uses createImageBitmap on a Blob; raw RGB goes through ImageData.
// Small worlds' H.264 is coded at ready.codec.scale x the model's size (each pixel a block); the
// player draws every frame into the model-size canvas, which scales it back.

const NAL_IDR = 5;

/** Why this browser cannot decode `codec` with WebCodecs, or null when it can. */
export async function h264Problem(codec = "avc1.42c01e") {
  if (!window.isSecureContext) return "WebCodecs needs a secure context (https, or http://localhost)";
  if (typeof VideoDecoder === "undefined") return "this browser has no WebCodecs VideoDecoder";
  try {
    const { supported } = await VideoDecoder.isConfigSupported({ codec, optimizeForLatency: true });
    return supported ? null : `this browser cannot decode H.264 (${codec})`;
  } catch (err) {
    return `H.264 check failed: ${err.message}`;
  }
}

/** True when an Annex-B access unit holds an IDR slice (a decoder can start here). */
export function isKeyframe(bytes) {
  for (let i = 0; i + 3 < bytes.length; i++) {
    if (bytes[i] === 0 && bytes[i + 1] === 0 && bytes[i + 2] === 1) {
      if ((bytes[i + 3] & 0x1f) === NAL_IDR) return true;
      i += 2;
    }
  }
  return false;
}

export class JpegDecoder {
  name = "jpeg";

  decode(msg, slot) {
    msg.data.forEach((bytes, i) => {
      createImageBitmap(new Blob([bytes], { type: "image/jpeg" })).then(
        (bitmap) => slot.put(i, bitmap),
        () => slot.skip(i),
      );
    });
  }

  reset() {}
  close() {}
}

export class RawDecoder {
  name = "raw";

  decode(msg, slot) {
    const [count, height, width] = msg.data.shape;
    const rgb = msg.data.data;
    for (let i = 0; i < count; i++) {
      const rgba = rgbToRgba(rgb, i * width * height, width * height);
      createImageBitmap(new ImageData(rgba, width, height)).then(
        (bitmap) => slot.put(i, bitmap),
        () => slot.skip(i),
      );
    }
  }

  reset() {}
  close() {}
}

/**
 * H.264 through WebCodecs. `onError(err, decodedAny)` reports a dead decoder: the caller
 * reconnects (a new socket starts with an IDR) or falls back to JPEG when nothing ever decoded.
 */
export class H264Decoder {
  name = "h264";

  constructor(codec, onError) {
    this.codec = codec; // WebCodecs codec string from ready.codec.codec, e.g. "avc1.42c00a"
    this.onError = onError;
    this.pending = new Map(); // timestamp -> {slot, i}: where each output frame goes
    this.decodedAny = false; // at least one frame came out
    this.ts = 0; // timestamps are a counter (µs); only used to match outputs to frames
    this.open();
  }

  open() {
    this.needKey = true; // after configure a decoder must start at a keyframe
    this.decoder = new VideoDecoder({
      output: (frame) => this.output(frame),
      error: (err) => this.failed(err),
    });
    this.decoder.configure({ codec: this.codec, optimizeForLatency: true });
  }

  output(frame) {
    const where = this.pending.get(frame.timestamp);
    this.pending.delete(frame.timestamp);
    this.decodedAny = true;
    if (!where || !where.slot) {
      frame.close(); // a re-sent chunk fed only to rebuild the reference frames
      return;
    }
    createImageBitmap(frame).then(
      (bitmap) => where.slot.put(where.i, bitmap),
      () => where.slot.skip(where.i),
    ).finally(() => frame.close());
  }

  failed(err) {
    for (const { slot, i } of this.pending.values()) slot?.skip(i);
    this.pending.clear();
    this.onError?.(err, this.decodedAny);
  }

  /** Decode a chunk; `slot` null decodes without showing (a duplicate after a reconnect). */
  decode(msg, slot) {
    msg.data.forEach((bytes, i) => {
      const key = isKeyframe(bytes);
      if (this.decoder.state !== "configured" || (this.needKey && !key)) {
        slot?.skip(i); // cannot decode until the next keyframe
        return;
      }
      this.needKey = false;
      const timestamp = this.ts++;
      this.pending.set(timestamp, { slot, i });
      try {
        this.decoder.decode(new EncodedVideoChunk({ type: key ? "key" : "delta", timestamp, data: bytes }));
      } catch (err) {
        this.pending.delete(timestamp);
        slot?.skip(i);
        this.failed(err);
      }
    });
  }

  /** A new socket: its stream restarts with an IDR, so drop what is queued and wait for one. */
  reset() {
    for (const { slot, i } of this.pending.values()) slot?.skip(i);
    this.pending.clear();
    if (this.decoder.state === "closed") this.open();
    else {
      this.decoder.reset();
      this.decoder.configure({ codec: this.codec, optimizeForLatency: true });
      this.needKey = true;
    }
  }

  close() {
    for (const { slot, i } of this.pending.values()) slot?.skip(i);
    this.pending.clear();
    if (this.decoder.state !== "closed") this.decoder.close();
  }
}

/** One picture as an ImageBitmap: `ready.frame`, a {dtype, shape, data} (H, W, 3) array or JPEG bytes. */
export function decodeStill(frame) {
  if (frame instanceof Uint8Array) return createImageBitmap(new Blob([frame], { type: "image/jpeg" }));
  const [height, width] = frame.shape;
  return createImageBitmap(new ImageData(rgbToRgba(frame.data, 0, width * height), width, height));
}

/** `pixels` RGB pixels starting at pixel `first` of `rgb`, as opaque RGBA. */
function rgbToRgba(rgb, first, pixels) {
  const rgba = new Uint8ClampedArray(pixels * 4);
  for (let p = 0, s = first * 3; p < rgba.length; p += 4, s += 3) {
    rgba[p] = rgb[s];
    rgba[p + 1] = rgb[s + 1];
    rgba[p + 2] = rgb[s + 2];
    rgba[p + 3] = 255;
  }
  return rgba;
}

/** The decoder for a `ready.codec`. */
export function makeDecoder(codecInfo, onError) {
  if (codecInfo.name === "h264") return new H264Decoder(codecInfo.codec, onError);
  if (codecInfo.name === "raw") return new RawDecoder();
  return new JpegDecoder();
}
