// Keyboard, pointer-lock mouse and an optional gamepad, mapped to the model's action space
// (ready.model.action_space): key names come from the model, never from this file. W/A/S/D and
// the arrows drive "w"/"a"/"s"/"d" (or "up"/"left"/... when the model names them so); Space is
// "space"; other keys map to their own name ("KeyQ" -> "q", "ShiftLeft" -> "shift") when the
// model knows it. Mouse motion is summed while the pointer is locked to the canvas.

const CODE_NAMES = {
  Space: "space", Enter: "enter", Tab: "tab",
  ShiftLeft: "shift", ShiftRight: "shift", ControlLeft: "ctrl", ControlRight: "ctrl",
  AltLeft: "alt", AltRight: "alt",
  ArrowUp: "up", ArrowDown: "down", ArrowLeft: "left", ArrowRight: "right",
};
const ARROWS_AS_WASD = { ArrowUp: "w", ArrowLeft: "a", ArrowDown: "s", ArrowRight: "d" };
const STICK_THRESHOLD = 0.5; // gamepad stick deflection that counts as a key
const STICK_MOUSE_PX = 12; // mouse px per poll at full right-stick deflection

export class Input {
  constructor(surface, onChange) {
    this.surface = surface; // the element that takes pointer lock (the canvas)
    this.onChange = onChange; // called on every change of the held keys
    this.known = new Set(); // the model's key names
    this.mouseEnabled = false;
    this.held = new Map(); // KeyboardEvent.code -> model key name
    this.padKeys = new Set(); // model keys held on the gamepad
    this.dx = 0;
    this.dy = 0;
    this.listen();
  }

  setActionSpace({ keys, mouse }) {
    this.known = new Set(keys);
    this.mouseEnabled = Boolean(mouse);
    this.held.clear();
    this.padKeys.clear();
  }

  /** The model key for a KeyboardEvent.code, or null. */
  keyName(code) {
    let name = CODE_NAMES[code];
    if (!name && code.startsWith("Key")) name = code.slice(3).toLowerCase();
    if (!name && code.startsWith("Digit")) name = code.slice(5);
    if (name && this.known.has(name)) return name;
    const wasd = ARROWS_AS_WASD[code];
    return wasd && this.known.has(wasd) ? wasd : null;
  }

  /** Model keys held now, sorted. */
  keys() {
    return [...new Set([...this.held.values(), ...this.padKeys])].sort();
  }

  /** Mouse motion since the last call, [dx, dy] px. */
  takeMouse() {
    const out = [this.dx, this.dy];
    this.dx = this.dy = 0;
    return out;
  }

  get moved() {
    return this.dx !== 0 || this.dy !== 0;
  }

  releaseAll() {
    if (!this.held.size && !this.padKeys.size) return;
    this.held.clear();
    this.padKeys.clear();
    this.onChange();
  }

  listen() {
    const typing = (e) => e.target instanceof HTMLElement && e.target.closest("input, select, textarea");
    window.addEventListener("keydown", (e) => {
      if (typing(e) || e.ctrlKey || e.metaKey) return;
      const name = this.keyName(e.code);
      if (!name) return;
      e.preventDefault(); // no page scrolling, no button activation by Space
      if (this.held.get(e.code) === name) return; // auto-repeat
      this.held.set(e.code, name);
      this.onChange();
    });
    window.addEventListener("keyup", (e) => {
      if (!this.held.has(e.code)) return;
      e.preventDefault();
      this.held.delete(e.code);
      this.onChange();
    });
    window.addEventListener("blur", () => this.releaseAll());
    document.addEventListener("visibilitychange", () => document.hidden && this.releaseAll());
    this.surface.addEventListener("click", () => {
      if (this.mouseEnabled && document.pointerLockElement !== this.surface) {
        this.surface.requestPointerLock?.()?.catch?.(() => {});
      }
    });
    document.addEventListener("mousemove", (e) => {
      if (document.pointerLockElement !== this.surface) return;
      this.dx += e.movementX;
      this.dy += e.movementY;
    });
  }

  /** Read the first gamepad: left stick / d-pad -> w/a/s/d, A -> space, right stick -> mouse. */
  pollGamepad() {
    const pad = [...(navigator.getGamepads?.() ?? [])].find((p) => p && p.connected);
    if (!pad) return;
    const [lx = 0, ly = 0, rx = 0, ry = 0] = pad.axes;
    const pressed = (i) => Boolean(pad.buttons[i]?.pressed);
    const want = new Set();
    const add = (on, name) => on && this.known.has(name) && want.add(name);
    add(ly < -STICK_THRESHOLD || pressed(12), "w");
    add(ly > STICK_THRESHOLD || pressed(13), "s");
    add(lx < -STICK_THRESHOLD || pressed(14), "a");
    add(lx > STICK_THRESHOLD || pressed(15), "d");
    add(pressed(0), "space");
    if (this.mouseEnabled) {
      if (Math.abs(rx) > 0.15) this.dx += rx * STICK_MOUSE_PX;
      if (Math.abs(ry) > 0.15) this.dy += ry * STICK_MOUSE_PX;
    }
    const changed = want.size !== this.padKeys.size || [...want].some((k) => !this.padKeys.has(k));
    this.padKeys = want;
    if (changed) this.onChange();
  }
}
