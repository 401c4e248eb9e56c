// A start image for image-started worlds: a picked file (or a same-origin URL) -> the `open.image`
// wire array, (H, W, 3) uint8 RGB. The picture is centre-cropped to the world's aspect ratio and
// resized to its frame size on the client: worlds without an image encoder take only that exact
// size, the others crop and resize anyway, and the result fits the server's 1 MiB message limit.

import { packArray } from "./protocol.js";

const MAX_BYTES = 900 * 1024; // RGB bytes sent: headroom under the server's 1 MiB message limit
const FALLBACK_SIDE = 640; // longest side when the world's frame size is not known

export class StartImageError extends Error {}

/** The frame size to send for a world {width, height} (or null) and a picture of size w x h. */
export function targetSize(world, w, h) {
  let [tw, th] = world ? [world.width, world.height] : fit(w, h, FALLBACK_SIDE);
  const scale = Math.min(1, Math.sqrt(MAX_BYTES / (tw * th * 3)));
  if (scale < 1) [tw, th] = [Math.floor(tw * scale), Math.floor(th * scale)];
  return [Math.max(1, tw), Math.max(1, th)];
}

function fit(w, h, side) {
  const scale = Math.min(1, side / Math.max(w, h));
  return [Math.round(w * scale), Math.round(h * scale)];
}

/**
 * `source` (a File or Blob) as an `open.image` array for `world` ({width, height} or null);
 * throws StartImageError, in words, when it is not a picture the browser can read.
 */
export async function readStartImage(source, world) {
  let bitmap;
  try {
    bitmap = await createImageBitmap(source);
  } catch (err) {
    const name = source.name ? `"${source.name}"` : "The start image";
    throw new StartImageError(`${name} could not be read as a picture (${err.message}); pick a PNG or JPEG.`);
  }
  const [width, height] = targetSize(world, bitmap.width, bitmap.height);
  // centre crop to the target's aspect ratio (what the server does with other sizes)
  const scale = Math.min(bitmap.width / width, bitmap.height / height);
  const [sw, sh] = [width * scale, height * scale];
  const canvas = new OffscreenCanvas(width, height);
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  ctx.imageSmoothingQuality = "high";
  ctx.drawImage(bitmap, (bitmap.width - sw) / 2, (bitmap.height - sh) / 2, sw, sh, 0, 0, width, height);
  bitmap.close();
  const rgba = ctx.getImageData(0, 0, width, height).data;
  const rgb = new Uint8Array(width * height * 3);
  for (let i = 0, j = 0; i < rgba.length; i += 4, j += 3) {
    rgb[j] = rgba[i];
    rgb[j + 1] = rgba[i + 1];
    rgb[j + 2] = rgba[i + 2]; // alpha dropped
  }
  return packArray(rgb, [height, width, 3]);
}

/** The picture at a same-origin `address` as a Blob; throws StartImageError otherwise. */
export async function fetchStartImage(address, location) {
  const url = new URL(address, location.href);
  if (url.origin !== location.origin) {
    throw new StartImageError(`?image= must be on this server (${location.origin}), not ${url.origin}.`);
  }
  const res = await fetch(url).catch((err) => ({ ok: false, statusText: err.message }));
  if (!res.ok) throw new StartImageError(`The start image ${url.pathname} could not be fetched (${res.statusText}).`);
  return res.blob();
}
