// Microphone capture: the context's rate -> `rate` (band-limited windowed-sinc resampling) ->
// 16-bit PCM chunks of `chunkMs`, posted to the main thread with the chunk's RMS level.
// Resampling runs here, on the audio thread, so the main thread only encodes and sends.

const PHASES = 64; // kernel table resolution (taps per input sample)
const ZEROS = 24; // sinc zero crossings on each side of the centre
const PASS = 0.97; // cutoff as a fraction of the lower Nyquist: speech up to ~7.8 kHz at 16 kHz matters to ASR
const BETA = 8; // Kaiser window: ~80 dB stopband

function besselI0(x) {
  let sum = 1;
  let term = 1;
  for (let k = 1; k < 30; k++) {
    term *= (x / (2 * k)) ** 2;
    sum += term;
  }
  return sum;
}

class PcmCapture extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = options.processorOptions || {};
    this.outRate = o.rate || 16000;
    this.step = sampleRate / this.outRate; // input samples per output sample
    this.chunk = Math.max(1, Math.round((this.outRate * (o.chunkMs || 40)) / 1000));
    // Low-pass just under the lower of the two Nyquist rates, in cycles per input sample.
    this.fc = 0.5 * Math.min(1, 1 / this.step) * PASS;
    this.half = Math.ceil(ZEROS / (2 * this.fc)); // kernel half-width in input samples
    const n = this.half * PHASES + 2;
    this.kernel = new Float32Array(n);
    for (let k = 0; k < n; k++) {
      const x = k / PHASES;
      const arg = 2 * Math.PI * this.fc * x;
      const sinc = x === 0 ? 1 : Math.sin(arg) / arg;
      const r = x / this.half;
      const w = r >= 1 ? 0 : besselI0(BETA * Math.sqrt(1 - r * r)) / besselI0(BETA);
      this.kernel[k] = 2 * this.fc * sinc * w;
    }
    this.buf = new Float32Array(8192);
    this.len = 0; // valid samples in buf
    this.base = 0; // absolute input index of buf[0]
    this.t = 0; // absolute input position of the next output sample
    this.out = new Int16Array(this.chunk);
    this.fill = 0;
    this.sumSq = 0;
    this.active = true;
    this.port.onmessage = (e) => {
      if (e.data && e.data.type === 'stop') this.active = false;
    };
  }

  tap(d) {
    const p = Math.abs(d) * PHASES;
    const i = p | 0;
    if (i + 1 >= this.kernel.length) return 0;
    const f = p - i;
    return this.kernel[i] * (1 - f) + this.kernel[i + 1] * f;
  }

  push(x) {
    if (this.len + x.length > this.buf.length) {
      // Drop what no future output sample needs, then grow if that was not enough.
      const keep = Math.max(0, Math.floor(this.t) - this.half - 1 - this.base);
      if (keep > 0) {
        this.buf.copyWithin(0, keep, this.len);
        this.len -= keep;
        this.base += keep;
      }
      if (this.len + x.length > this.buf.length) {
        const bigger = new Float32Array(this.buf.length * 2);
        bigger.set(this.buf.subarray(0, this.len));
        this.buf = bigger;
      }
    }
    this.buf.set(x, this.len);
    this.len += x.length;
  }

  emit(v) {
    const s = Math.max(-1, Math.min(1, v));
    this.out[this.fill++] = s < 0 ? s * 0x8000 : s * 0x7fff;
    this.sumSq += s * s;
    if (this.fill === this.chunk) {
      const level = Math.sqrt(this.sumSq / this.chunk);
      const pcm = this.out.buffer;
      this.port.postMessage({ type: 'chunk', pcm, level }, [pcm]);
      this.out = new Int16Array(this.chunk);
      this.fill = 0;
      this.sumSq = 0;
    }
  }

  process(inputs) {
    if (!this.active) return false;
    const input = inputs[0];
    if (!input || input.length === 0) return true; // no track connected yet
    const ch = input[0];
    if (input.length > 1) {
      // mix down to mono
      const mono = new Float32Array(ch.length);
      for (let c = 0; c < input.length; c++) for (let i = 0; i < ch.length; i++) mono[i] += input[c][i] / input.length;
      this.push(mono);
    } else {
      this.push(ch);
    }
    const end = this.base + this.len;
    while (this.t + this.half < end) {
      const lo = Math.max(this.base, Math.ceil(this.t - this.half));
      const hi = Math.floor(this.t + this.half);
      let acc = 0;
      for (let i = lo; i <= hi; i++) acc += this.buf[i - this.base] * this.tap(i - this.t);
      // sum of h(i - t) over unit-spaced i is ~1 (the integral of 2fc*sinc(2fc*x)): unity DC gain
      this.emit(acc);
      this.t += this.step;
    }
    return true;
  }
}

registerProcessor('pcm-capture', PcmCapture);
