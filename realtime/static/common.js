// Shared helpers: URLs (with ?token= passed through), base64, the playback context and player,
// and microphone capture. Everything is plain ES modules; nothing is fetched from outside.

const query = new URLSearchParams(location.search);
export const token = query.get('token');

/** Stats the tests (and curious users) read: window.realtimeStats.{agent,tts,asr}. */
export const realtimeStats = (window.realtimeStats = { agent: {}, tts: {}, asr: {} });

function withToken(u) {
  u.search = '';
  u.hash = '';
  if (token) u.searchParams.set('token', token);
  return u;
}

/** A ws(s):// URL for `path` relative to the page (works behind a path prefix). */
export function wsUrl(path) {
  const u = withToken(new URL(path, location.href));
  u.protocol = u.protocol === 'https:' ? 'wss:' : 'ws:';
  return u.href;
}

export function httpUrl(path) {
  return withToken(new URL(path, location.href)).href;
}

export function bytesToB64(bytes) {
  const u8 = bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes);
  let s = '';
  for (let i = 0; i < u8.length; i += 0x8000) s += String.fromCharCode.apply(null, u8.subarray(i, i + 0x8000));
  return btoa(s);
}

export function b64ToBuffer(b64) {
  const s = atob(b64);
  const u8 = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) u8[i] = s.charCodeAt(i);
  return u8.buffer;
}

export const $ = (sel, root = document) => root.querySelector(sel);

export function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === 'class') e.className = v;
    else if (k === 'text') e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

export const fmtMs = (ms) => (ms == null || Number.isNaN(ms) ? '–' : `${Math.round(ms)} ms`);

// ---- playback ----

export const PLAYBACK_RATE = 24000;
let playbackCtx = null;
let playbackReady = null;

/** The one playback AudioContext (24 kHz: the rate every endpoint here is asked to send). */
export async function playbackContext() {
  if (!playbackCtx) {
    try {
      playbackCtx = new AudioContext({ sampleRate: PLAYBACK_RATE, latencyHint: 'interactive' });
    } catch {
      // a browser without arbitrary context rates: the player worklet interpolates to the device rate
      playbackCtx = new AudioContext({ latencyHint: 'interactive' });
    }
    playbackReady = playbackCtx.audioWorklet.addModule(new URL('./player-worklet.js', import.meta.url));
  }
  await playbackReady;
  if (playbackCtx.state === 'suspended') await playbackCtx.resume();
  return playbackCtx;
}

/** A jitter-buffered stream player (player-worklet.js) with its latest stats mirrored in `stats`. */
export class Player {
  static async create(rate, stats, prebufferMs = 100) {
    const ctx = await playbackContext();
    const node = new AudioWorkletNode(ctx, 'jitter-player', {
      numberOfInputs: 0,
      numberOfOutputs: 1,
      outputChannelCount: [1],
      processorOptions: { rate, prebufferMs },
    });
    node.connect(ctx.destination);
    return new Player(node, stats);
  }

  constructor(node, stats) {
    this.node = node;
    this.stats = stats;
    this.listeners = [];
    this.pendingClear = null;
    node.port.onmessage = (e) => {
      const m = e.data;
      if (m.type === 'stats') {
        const { type, ...rest } = m;
        Object.assign(this.stats, rest);
      } else if (m.type === 'cleared' && this.pendingClear) {
        this.pendingClear(m);
        this.pendingClear = null;
      }
      for (const fn of this.listeners) fn(m);
    };
  }

  on(fn) {
    this.listeners.push(fn);
  }

  begin(item = 0) {
    this.node.port.postMessage({ type: 'begin', item });
  }

  /** `pcm`: ArrayBuffer of s16le samples (transferred). */
  push(pcm, item = 0) {
    this.node.port.postMessage({ type: 'audio', pcm, item }, [pcm]);
  }

  end() {
    this.node.port.postMessage({ type: 'end' });
  }

  /** Stop at once; resolves to {item, playedMs} of what was actually heard of the current item. */
  clear() {
    return new Promise((resolve) => {
      this.pendingClear = resolve;
      this.node.port.postMessage({ type: 'clear' });
    });
  }

  close() {
    this.node.disconnect();
    this.node.port.onmessage = null;
  }
}

// ---- capture ----

/**
 * Microphone -> capture worklet (resamples to `rate`) -> onChunk(ArrayBuffer s16le, level).
 * `processing`: browser echo cancellation / noise suppression / gain control (wanted for the
 * voice agent, where the speakers play the reply; unwanted for plain transcription).
 */
export class Mic {
  static async open({ rate, chunkMs = 40, processing = true, onChunk }) {
    const stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: processing, noiseSuppression: processing, autoGainControl: processing },
    });
    const ctx = new AudioContext({ latencyHint: 'interactive' });
    await ctx.audioWorklet.addModule(new URL('./capture-worklet.js', import.meta.url));
    if (ctx.state === 'suspended') await ctx.resume();
    const src = ctx.createMediaStreamSource(stream);
    const node = new AudioWorkletNode(ctx, 'pcm-capture', {
      numberOfInputs: 1,
      numberOfOutputs: 1,
      outputChannelCount: [1],
      processorOptions: { rate, chunkMs },
    });
    node.port.onmessage = (e) => {
      if (e.data.type === 'chunk') onChunk(e.data.pcm, e.data.level);
    };
    src.connect(node);
    node.connect(ctx.destination); // silent output; keeps the node pulled by the graph
    return new Mic(stream, ctx, node, rate);
  }

  constructor(stream, ctx, node, rate) {
    this.stream = stream;
    this.ctx = ctx;
    this.node = node;
    this.rate = rate;
    this.inputRate = ctx.sampleRate;
  }

  close() {
    this.node.port.postMessage({ type: 'stop' });
    this.node.port.onmessage = null;
    for (const t of this.stream.getTracks()) t.stop();
    this.ctx.close();
  }
}

/** A level meter element's width from an RMS level. */
export function showLevel(meter, level) {
  const db = 20 * Math.log10(level + 1e-6);
  meter.style.width = `${Math.max(0, Math.min(100, ((db + 60) / 60) * 100))}%`;
}
