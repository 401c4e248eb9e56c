// Protocol v1 (docs/PROTOCOL.md), sans I/O: client messages -> bytes, bytes -> server messages.
// Every message is one binary websocket frame holding one msgpack map with a string `type`.
// Arrays travel as {dtype, shape, data}: little-endian, C order; the receiver checks dtype
// against an allow-list and len(data) == prod(shape) * itemsize. Names match web/messages.py.

import { decode, encode } from "./msgpack.js";

export const PROTOCOL_VERSION = 1;
export const SERVER_TYPES = new Set(["ready", "frames", "cancelled", "prompted", "forked", "done", "pong", "error", "closed"]);
export const CODECS = ["h264", "jpeg", "raw"];

export class ProtocolError extends Error {}

const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

// wire dtype -> typed array (float16 stays raw bits: no client message needs its values)
const DTYPES = {
  bool: Uint8Array,
  uint8: Uint8Array,
  int8: Int8Array,
  uint16: Uint16Array,
  int16: Int16Array,
  int32: Int32Array,
  int64: BigInt64Array,
  float16: Uint16Array,
  float32: Float32Array,
  float64: Float64Array,
};
const DTYPE_OF = new Map([
  [Uint8Array, "uint8"], [Int8Array, "int8"], [Uint16Array, "uint16"], [Int16Array, "int16"],
  [Int32Array, "int32"], [BigInt64Array, "int64"], [Float32Array, "float32"], [Float64Array, "float64"],
]);

/** The wire map of a typed array; `shape` defaults to 1-D. */
export function packArray(typed, shape = [typed.length]) {
  const dtype = DTYPE_OF.get(typed.constructor);
  if (!dtype) throw new ProtocolError(`no wire dtype for ${typed.constructor.name}`);
  if (!LITTLE_ENDIAN) throw new ProtocolError("big-endian hosts are not supported");
  if (shape.reduce((a, b) => a * b, 1) !== typed.length) throw new ProtocolError("shape does not match");
  return { dtype, shape, data: new Uint8Array(typed.buffer, typed.byteOffset, typed.byteLength) };
}

/** {dtype, shape, data: TypedArray} from a wire map, checked. */
export function unpackArray(obj) {
  if (!obj || typeof obj !== "object" || Object.keys(obj).sort().join() !== "data,dtype,shape") {
    throw new ProtocolError("bad array: expected a map with exactly dtype, shape, data");
  }
  const { dtype, shape, data } = obj;
  const Typed = Object.hasOwn(DTYPES, dtype) ? DTYPES[dtype] : null;
  if (!Typed) throw new ProtocolError(`bad array: dtype ${dtype} is not allowed`);
  if (!Array.isArray(shape) || shape.length > 4 || !shape.every((d) => Number.isSafeInteger(d) && d >= 0)) {
    throw new ProtocolError("bad array: shape must be a list of at most 4 sizes");
  }
  const count = shape.reduce((a, b) => a * b, 1);
  if (!(data instanceof Uint8Array) || data.length !== count * Typed.BYTES_PER_ELEMENT) {
    throw new ProtocolError(`bad array: data does not hold ${count} ${dtype}`);
  }
  if (!LITTLE_ENDIAN) throw new ProtocolError("big-endian hosts are not supported");
  const aligned = data.byteOffset % Typed.BYTES_PER_ELEMENT === 0 ? data : data.slice();
  return { dtype, shape, data: new Typed(aligned.buffer, aligned.byteOffset, count) };
}

/** Bytes of one client message (fields left undefined are omitted). */
export function pack(msg) {
  if (typeof msg.type !== "string") throw new ProtocolError("a message needs a type");
  return encode(msg);
}

/** One server message from the bytes of a websocket frame; throws ProtocolError. */
export function parse(data) {
  let msg;
  try {
    msg = decode(data);
  } catch (err) {
    throw new ProtocolError(`not msgpack: ${err.message}`);
  }
  if (!msg || typeof msg !== "object" || Array.isArray(msg) || typeof msg.type !== "string") {
    throw new ProtocolError("a message must be a map with a string type");
  }
  if (msg.type === "frames") checkFrames(msg);
  if (msg.type === "ready" && msg.frame !== undefined) checkReadyFrame(msg);
  return msg;
}

// ready.frame (an addition): the world's latest frame, (H, W, 3) uint8 for raw, one JPEG otherwise
function checkReadyFrame(msg) {
  if (msg.codec?.name === "raw") {
    msg.frame = unpackArray(msg.frame);
    const { dtype, shape } = msg.frame;
    if (dtype !== "uint8" || shape.length !== 3 || shape[2] !== 3) {
      throw new ProtocolError("ready: raw frame must be (H, W, 3) uint8");
    }
  } else if (!(msg.frame instanceof Uint8Array)) {
    throw new ProtocolError("ready: frame must be one JPEG");
  }
}

function checkFrames(msg) {
  const { chunk, frame0, count, codec, data } = msg;
  if (![chunk, frame0, count].every(Number.isSafeInteger) || chunk < 1 || count < 1) {
    throw new ProtocolError("frames: bad chunk, frame0 or count");
  }
  if (codec === "raw") {
    msg.data = unpackArray(data);
    const [t, , , c] = msg.data.shape;
    if (msg.data.dtype !== "uint8" || msg.data.shape.length !== 4 || t !== count || c !== 3) {
      throw new ProtocolError("frames: raw data must be (count, H, W, 3) uint8");
    }
  } else {
    msg.data = data instanceof Uint8Array ? [data] : data; // a bare bin when count is 1
    if (!Array.isArray(msg.data) || msg.data.length !== count || !msg.data.every((d) => d instanceof Uint8Array)) {
      throw new ProtocolError(`frames: expected ${count} payloads`);
    }
  }
  msg.timings = msg.timings && typeof msg.timings === "object" ? msg.timings : {};
}

/** Client message builders (docs/PROTOCOL.md, "Client -> server"). */
export const client = {
  open: ({ model, seed, codec = "jpeg", maxAhead, token, image, prompt, mode = "realtime" } = {}) => ({
    type: "open",
    model: model || undefined,
    seed: Number.isSafeInteger(seed) ? seed : undefined,
    prompt: prompt || undefined, // text worlds only
    image: image || undefined, // a packArray map, (H, W, 3) uint8
    mode,
    codec,
    max_ahead: maxAhead || undefined,
    token: token || undefined,
  }),
  action: (seq, keys, mouse = [0, 0], t = undefined, vector = undefined) => ({
    type: "action",
    seq,
    keys,
    mouse,
    vector: vector ? packArray(Float32Array.from(vector)) : undefined,
    t,
  }),
  ack: (chunk) => ({ type: "ack", chunk }),
  pause: (seq) => ({ type: "pause", seq }),
  resume: (seq) => ({ type: "resume", seq }),
  cancel: (seq) => ({ type: "cancel", seq }),
  reset: (seq, seed, prompt) => ({
    type: "reset",
    seq,
    seed: Number.isSafeInteger(seed) ? seed : undefined,
    prompt: prompt || undefined, // none: the session keeps its prompt
  }),
  prompt: (seq, text) => ({ type: "prompt", seq, text }), // text worlds: switch mid-session
  fork: (seq) => ({ type: "fork", seq }),
  rewind: (seq, chunk) => ({ type: "rewind", seq, chunk }), // a v1 addition: answered by `ready`
  ping: (t) => ({ type: "ping", t }),
  close: () => ({ type: "close" }),
};

/** ws:// or wss:// URL of the session endpoint, for a new session or a resume. */
export function sessionUrl(location, { resume, codec } = {}) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const url = new URL(`${scheme}//${location.host}/v1/session`);
  if (resume) url.searchParams.set("resume", resume);
  if (resume && codec) url.searchParams.set("codec", codec);
  return url.toString();
}
