// Jitter-buffered playback of streamed 16-bit PCM.
//
// Messages in (port):
//   {type:'begin', item}           a response starts: wait for `prebufferMs` of audio, then play
//   {type:'audio', pcm, item}      an ArrayBuffer of s16le samples at `rate` (resampled here if the
//                                  context runs at another rate), tagged with a numeric item id
//   {type:'end'}                   the response's audio is complete: play out what is left
//   {type:'clear'}                 barge-in: drop everything now; answers {type:'cleared', item, playedMs}
// Messages out: 'started' (first sample of a response played), 'underrun', 'drained' (response
// fully played), 'cleared', and 'stats' about every 50 ms.
//
// An underrun is the buffer running dry after playback started and before 'end' arrived, i.e.
// a gap the listener hears in the middle of a response. Waiting for the first audio is not one.

class JitterPlayer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const o = options.processorOptions || {};
    this.inRate = o.rate || 24000;
    this.prebuffer = Math.round((sampleRate * (o.prebufferMs ?? 100)) / 1000);
    this.queue = []; // [{data: Float32Array, item}]
    this.head = 0; // read offset into queue[0].data
    this.buffered = 0; // samples queued (context rate)
    this.state = 'idle'; // idle | buffering | playing
    this.ended = true;
    this.started = false; // playback of the current response has begun
    this.item = -1; // item of the sample last played
    this.itemPlayed = 0; // samples of `item` played
    this.pos = 0; // linear resampler phase (only when inRate != sampleRate)
    this.last = 0;
    this.quanta = 0;
    this.s = {
      samplesPlayed: 0, // every response, context-rate samples
      underruns: 0,
      underrunSamples: 0,
      responses: 0,
      maxBufferedSamples: 0,
      droppedSamples: 0, // thrown away by 'clear'
    };
    this.port.onmessage = (e) => this.onMessage(e.data);
  }

  toFloat(buf) {
    const pcm = new Int16Array(buf);
    if (this.inRate === sampleRate) {
      const f = new Float32Array(pcm.length);
      for (let i = 0; i < pcm.length; i++) f[i] = pcm[i] / 32768;
      return f;
    }
    // Streaming linear interpolation between the previous chunk's last sample and this chunk.
    const step = this.inRate / sampleRate;
    const out = [];
    let pos = this.pos;
    while (pos < pcm.length) {
      const i = Math.floor(pos);
      const a = i === 0 ? this.last : pcm[i - 1] / 32768;
      const b = pcm[i] / 32768;
      const f = pos - i;
      out.push(a + (b - a) * f);
      pos += step;
    }
    this.pos = pos - pcm.length;
    if (pcm.length) this.last = pcm[pcm.length - 1] / 32768;
    return Float32Array.from(out);
  }

  onMessage(m) {
    if (m.type === 'begin') {
      this.ended = false;
      this.started = false;
      this.s.responses++;
      if (this.state === 'idle') this.state = 'buffering';
    } else if (m.type === 'audio') {
      const data = this.toFloat(m.pcm);
      if (data.length === 0) return;
      if (this.ended && this.state === 'idle') {
        // audio without 'begin': treat it as a new response
        this.ended = false;
        this.started = false;
        this.s.responses++;
        this.state = 'buffering';
      }
      this.queue.push({ data, item: m.item ?? 0 });
      this.buffered += data.length;
      if (this.buffered > this.s.maxBufferedSamples) this.s.maxBufferedSamples = this.buffered;
    } else if (m.type === 'end') {
      this.ended = true;
      if (this.buffered === 0 && this.state !== 'idle') this.finish();
    } else if (m.type === 'clear') {
      const played = this.itemPlayed;
      this.s.droppedSamples += this.buffered;
      this.queue = [];
      this.head = 0;
      this.buffered = 0;
      this.state = 'idle';
      this.ended = true;
      this.port.postMessage({ type: 'cleared', item: this.item, playedMs: (played * 1000) / sampleRate });
      this.postStats();
    }
  }

  finish() {
    this.state = 'idle';
    this.port.postMessage({ type: 'drained', item: this.item, itemPlayedMs: (this.itemPlayed * 1000) / sampleRate });
    this.postStats();
  }

  postStats() {
    this.port.postMessage({
      type: 'stats',
      ...this.s,
      state: this.state,
      bufferedMs: (this.buffered * 1000) / sampleRate,
      playedMs: (this.s.samplesPlayed * 1000) / sampleRate,
      underrunMs: (this.s.underrunSamples * 1000) / sampleRate,
      item: this.item,
      itemPlayedMs: (this.itemPlayed * 1000) / sampleRate,
      sampleRate,
    });
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    const n = out.length;
    let i = 0;
    if (this.state === 'buffering' && this.buffered > 0 && (this.buffered >= this.prebuffer || this.ended)) {
      this.state = 'playing';
      if (!this.started) {
        this.started = true;
        this.port.postMessage({ type: 'started', item: this.queue[0].item, time: currentTime });
      }
    }
    if (this.state === 'playing') {
      while (i < n && this.queue.length) {
        const c = this.queue[0];
        if (c.item !== this.item) {
          this.item = c.item;
          this.itemPlayed = 0;
        }
        const take = Math.min(n - i, c.data.length - this.head);
        out.set(c.data.subarray(this.head, this.head + take), i);
        i += take;
        this.head += take;
        this.buffered -= take;
        this.itemPlayed += take;
        this.s.samplesPlayed += take;
        if (this.head === c.data.length) {
          this.queue.shift();
          this.head = 0;
        }
      }
      if (i < n) {
        if (this.ended) {
          this.finish();
        } else {
          this.state = 'buffering';
          this.s.underruns++;
          this.port.postMessage({ type: 'underrun', count: this.s.underruns });
        }
      }
    }
    if (this.state === 'buffering' && this.started) this.s.underrunSamples += n - i;
    for (let k = i; k < n; k++) out[k] = 0;
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    if (++this.quanta % 16 === 0) this.postStats();
    return true;
  }
}

registerProcessor('jitter-player', JitterPlayer);
