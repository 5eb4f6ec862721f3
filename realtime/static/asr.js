// ASR playground: microphone -> capture worklet (16 kHz s16le) -> /v1/asr -> partial and final text.

import { $, bytesToB64, el, fmtMs, Mic, realtimeStats, showLevel, wsUrl } from './common.js';

const RATE = 16000;
const stats = realtimeStats.asr;
let mic = null;
let ws = null;

function setStatus(text) {
  $('#asr-status').textContent = text;
}

function setRunning(on) {
  $('#asr-start').disabled = on;
  $('#asr-stop').disabled = !on;
}

async function start() {
  setRunning(true);
  stats.finals = [];
  stats.partials = 0;
  stats.sentMs = 0;
  $('#asr-finals').replaceChildren();
  $('#asr-partial').textContent = '';
  const pending = []; // audio captured before the server is ready
  const sock = (ws = new WebSocket(wsUrl('v1/asr')));
  let ready = false;
  const send = (pcm) => {
    sock.send(JSON.stringify({ type: 'audio', audio: bytesToB64(pcm) }));
    stats.sentMs += (pcm.byteLength / 2 / RATE) * 1000;
  };
  sock.onopen = () => sock.send(JSON.stringify({ type: 'start', sample_rate: RATE, format: 'pcm_s16le', interim: true }));
  sock.onmessage = (e) => {
    const m = JSON.parse(e.data);
    if (m.type === 'ready') {
      ready = true;
      stats.model = m.model;
      setStatus(`listening (${m.model})`);
      for (const p of pending.splice(0)) send(p);
    } else if (m.type === 'partial') {
      stats.partials++;
      $('#asr-partial').textContent = m.text;
    } else if (m.type === 'final') {
      stats.finals.push(m.text);
      $('#asr-partial').textContent = '';
      const span = `${(m.start_ms / 1000).toFixed(2)}–${(m.end_ms / 1000).toFixed(2)} s`;
      // latency: end of the utterance in stream time -> the final shown, on the client's clock
      const lag = stats.sentMs - m.end_ms;
      $('#asr-finals').append(el('li', {}, el('span', { class: 'when', text: span }), el('span', { text: m.text })));
      stats.lastFinalLagMs = lag;
      $('#asr-lag').textContent = fmtMs(lag);
    } else if (m.type === 'speech_started') {
      $('#asr-vad').classList.add('on');
    } else if (m.type === 'speech_stopped') {
      $('#asr-vad').classList.remove('on');
    } else if (m.type === 'done') {
      stats.done = true;
      setStatus('done');
    } else if (m.type === 'error') {
      stats.error = `${m.code}: ${m.message}`;
      setStatus(`error: ${stats.error}`);
    }
  };
  sock.onclose = (e) => {
    if (ws === sock) ws = null;
    stopMic();
    setRunning(false);
    if (e.code !== 1000 && !stats.error) setStatus(`closed (${e.code}${e.reason ? ' ' + e.reason : ''})`);
  };
  try {
    mic = await Mic.open({
      rate: RATE,
      chunkMs: 40,
      processing: false, // raw audio transcribes best; nothing plays through the speakers here
      onChunk: (pcm, level) => {
        showLevel($('#asr-level'), level);
        if (sock.readyState !== WebSocket.OPEN) return;
        if (ready) send(pcm);
        else pending.push(pcm);
      },
    });
    stats.micRate = mic.inputRate;
  } catch (err) {
    setStatus(`microphone: ${err.message}`);
    sock.close();
  }
}

function stopMic() {
  if (mic) mic.close();
  mic = null;
  showLevel($('#asr-level'), 0);
}

function stop() {
  stopMic();
  if (ws && ws.readyState === WebSocket.OPEN) {
    ws.send(JSON.stringify({ type: 'stop' }));
    setStatus('finishing…');
  }
}

export function init() {
  $('#asr-start').addEventListener('click', () => start().catch((err) => setStatus(`error: ${err.message}`)));
  $('#asr-stop').addEventListener('click', stop);
  setRunning(false);
}
