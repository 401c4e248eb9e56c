// Minimal MessagePack (github.com/msgpack/msgpack/blob/master/spec.md): exactly what protocol v1
// needs, no dependencies. encode: null, booleans, numbers (integers up to 2**53 as ints, others
// as float64), bigint, strings, Uint8Array/ArrayBuffer/typed arrays (as bin), arrays, plain
// objects and Maps (as maps; undefined values are left out, like the server's exclude_none).
// decode: every type but ext (refused), maps become plain objects, bin becomes a Uint8Array copy,
// 64-bit ints become Numbers when exact, else BigInts. Malformed input throws MsgpackError.

export class MsgpackError extends Error {}

const utf8Encoder = new TextEncoder();
const utf8Decoder = new TextDecoder("utf-8", { fatal: true });
const MAX_DEPTH = 64; // nesting of arrays/maps; protocol v1 needs 6

export function encode(value) {
  const w = new Writer();
  w.value(value, 0);
  return w.buf.slice(0, w.pos);
}

class Writer {
  constructor() {
    this.buf = new Uint8Array(256);
    this.view = new DataView(this.buf.buffer);
    this.pos = 0;
  }

  room(n) {
    if (this.pos + n <= this.buf.length) return;
    let size = this.buf.length * 2;
    while (size < this.pos + n) size *= 2;
    const buf = new Uint8Array(size);
    buf.set(this.buf.subarray(0, this.pos));
    this.buf = buf;
    this.view = new DataView(buf.buffer);
  }

  head(byte, size, n) {
    // one type byte, then `n` as a big-endian unsigned int of `size` bytes (0: none)
    this.room(1 + size);
    this.buf[this.pos++] = byte;
    if (size === 1) this.view.setUint8(this.pos, n);
    else if (size === 2) this.view.setUint16(this.pos, n);
    else if (size === 4) this.view.setUint32(this.pos, n);
    this.pos += size;
  }

  raw(bytes) {
    this.room(bytes.length);
    this.buf.set(bytes, this.pos);
    this.pos += bytes.length;
  }

  value(v, depth) {
    if (depth > MAX_DEPTH) throw new MsgpackError("nested too deeply");
    if (v === null || v === undefined) this.head(0xc0, 0);
    else if (v === false) this.head(0xc2, 0);
    else if (v === true) this.head(0xc3, 0);
    else if (typeof v === "number") this.number(v);
    else if (typeof v === "bigint") this.bigint(v);
    else if (typeof v === "string") this.string(v);
    else if (v instanceof Uint8Array) this.bin(v);
    else if (v instanceof ArrayBuffer) this.bin(new Uint8Array(v));
    else if (ArrayBuffer.isView(v)) this.bin(new Uint8Array(v.buffer, v.byteOffset, v.byteLength));
    else if (Array.isArray(v)) {
      this.length(v.length, 0x90, 0xdc, 0xdd);
      for (const item of v) this.value(item, depth + 1);
    } else if (v instanceof Map) this.map([...v.entries()], depth);
    else if (typeof v === "object") this.map(Object.entries(v), depth);
    else throw new MsgpackError(`cannot encode ${typeof v}`);
  }

  length(n, fix, b16, b32) {
    if (n < 16) this.head(fix | n, 0);
    else if (n < 0x10000) this.head(b16, 2, n);
    else this.head(b32, 4, n);
  }

  map(entries, depth) {
    const kept = entries.filter(([, v]) => v !== undefined);
    if (kept.length < 16) this.head(0x80 | kept.length, 0);
    else if (kept.length < 0x10000) this.head(0xde, 2, kept.length);
    else this.head(0xdf, 4, kept.length);
    for (const [k, v] of kept) {
      this.value(k, depth + 1);
      this.value(v, depth + 1);
    }
  }

  number(v) {
    if (!Number.isSafeInteger(v)) {
      this.room(9);
      this.buf[this.pos++] = 0xcb;
      this.view.setFloat64(this.pos, v);
      this.pos += 8;
    } else if (v >= 0) {
      if (v < 0x80) this.head(v, 0);
      else if (v < 0x100) this.head(0xcc, 1, v);
      else if (v < 0x10000) this.head(0xcd, 2, v);
      else if (v < 0x100000000) this.head(0xce, 4, v);
      else this.bigint(BigInt(v));
    } else if (v >= -32) this.head(v & 0xff, 0);
    else if (v >= -0x80) this.int(0xd0, 1, v);
    else if (v >= -0x8000) this.int(0xd1, 2, v);
    else if (v >= -0x80000000) this.int(0xd2, 4, v);
    else this.bigint(BigInt(v));
  }

  int(byte, size, v) {
    this.room(1 + size);
    this.buf[this.pos++] = byte;
    if (size === 1) this.view.setInt8(this.pos, v);
    else if (size === 2) this.view.setInt16(this.pos, v);
    else this.view.setInt32(this.pos, v);
    this.pos += size;
  }

  bigint(v) {
    this.room(9);
    if (v >= 0n) {
      if (v >= 1n << 64n) throw new MsgpackError("integer too large");
      this.buf[this.pos++] = 0xcf;
      this.view.setBigUint64(this.pos, v);
    } else {
      if (v < -(1n << 63n)) throw new MsgpackError("integer too small");
      this.buf[this.pos++] = 0xd3;
      this.view.setBigInt64(this.pos, v);
    }
    this.pos += 8;
  }

  string(s) {
    const bytes = utf8Encoder.encode(s);
    const n = bytes.length;
    if (n < 32) this.head(0xa0 | n, 0);
    else if (n < 0x100) this.head(0xd9, 1, n);
    else if (n < 0x10000) this.head(0xda, 2, n);
    else this.head(0xdb, 4, n);
    this.raw(bytes);
  }

  bin(bytes) {
    const n = bytes.length;
    if (n < 0x100) this.head(0xc4, 1, n);
    else if (n < 0x10000) this.head(0xc5, 2, n);
    else this.head(0xc6, 4, n);
    this.raw(bytes);
  }
}

export function decode(data) {
  const bytes = data instanceof Uint8Array ? data : new Uint8Array(data);
  const r = new Reader(bytes);
  const value = r.value(0);
  if (r.pos !== bytes.length) throw new MsgpackError(`${bytes.length - r.pos} bytes after the value`);
  return value;
}

class Reader {
  constructor(bytes) {
    this.bytes = bytes;
    this.view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    this.pos = 0;
  }

  take(n) {
    if (this.pos + n > this.bytes.length) throw new MsgpackError("truncated data");
    const at = this.pos;
    this.pos += n;
    return at;
  }

  u(size) {
    const at = this.take(size);
    if (size === 1) return this.view.getUint8(at);
    if (size === 2) return this.view.getUint16(at);
    if (size === 4) return this.view.getUint32(at);
    return exact(this.view.getBigUint64(at));
  }

  i(size) {
    const at = this.take(size);
    if (size === 1) return this.view.getInt8(at);
    if (size === 2) return this.view.getInt16(at);
    if (size === 4) return this.view.getInt32(at);
    return exact(this.view.getBigInt64(at));
  }

  value(depth) {
    if (depth > MAX_DEPTH) throw new MsgpackError("nested too deeply");
    const b = this.bytes[this.take(1)];
    if (b < 0x80) return b; // positive fixint
    if (b < 0x90) return this.map(b & 0x0f, depth);
    if (b < 0xa0) return this.array(b & 0x0f, depth);
    if (b < 0xc0) return this.str(b & 0x1f);
    if (b >= 0xe0) return b - 0x100; // negative fixint
    switch (b) {
      case 0xc0: return null;
      case 0xc2: return false;
      case 0xc3: return true;
      case 0xc4: return this.bin(this.u(1));
      case 0xc5: return this.bin(this.u(2));
      case 0xc6: return this.bin(this.u(4));
      case 0xca: return this.view.getFloat32(this.take(4));
      case 0xcb: return this.view.getFloat64(this.take(8));
      case 0xcc: return this.u(1);
      case 0xcd: return this.u(2);
      case 0xce: return this.u(4);
      case 0xcf: return this.u(8);
      case 0xd0: return this.i(1);
      case 0xd1: return this.i(2);
      case 0xd2: return this.i(4);
      case 0xd3: return this.i(8);
      case 0xd9: return this.str(this.u(1));
      case 0xda: return this.str(this.u(2));
      case 0xdb: return this.str(this.u(4));
      case 0xdc: return this.array(this.u(2), depth);
      case 0xdd: return this.array(this.u(4), depth);
      case 0xde: return this.map(this.u(2), depth);
      case 0xdf: return this.map(this.u(4), depth);
      default: throw new MsgpackError(`unsupported type byte 0x${b.toString(16)}`); // ext, 0xc1
    }
  }

  str(n) {
    const at = this.take(n);
    try {
      return utf8Decoder.decode(this.bytes.subarray(at, at + n));
    } catch {
      throw new MsgpackError("invalid UTF-8 in a string");
    }
  }

  bin(n) {
    const at = this.take(n);
    return this.bytes.slice(at, at + n); // a copy: the message buffer can be dropped
  }

  array(n, depth) {
    if (n > this.bytes.length - this.pos) throw new MsgpackError("truncated data"); // >= 1 byte each
    const out = new Array(n);
    for (let k = 0; k < n; k++) out[k] = this.value(depth + 1);
    return out;
  }

  map(n, depth) {
    if (2 * n > this.bytes.length - this.pos) throw new MsgpackError("truncated data");
    const out = {};
    for (let k = 0; k < n; k++) {
      const key = this.value(depth + 1);
      if (typeof key !== "string") throw new MsgpackError("map keys must be strings");
      if (key === "__proto__") throw new MsgpackError("map key __proto__ refused");
      out[key] = this.value(depth + 1);
    }
    return out;
  }
}

function exact(big) {
  const n = Number(big);
  return Number.isSafeInteger(n) ? n : big;
}
