// TTS playground: text -> /v1/tts (JSON text frames, base64 audio) -> jitter-buffered playback.

import { $, b64ToBuffer, fmtMs, Player, PLAYBACK_RATE, realtimeStats, wsUrl } from './common.js';

const stats = realtimeStats.tts;
let player = null;
let ws = null;

function setStatus(text) {
  $('#tts-status').textContent = text;
}

function render() {
  $('#tts-ttfa').textContent = fmtMs(stats.ttfaMs);
  $('#tts-play-start').textContent = fmtMs(stats.playStartMs);
  $('#tts-server-ttfa').textContent = fmtMs(stats.serverTtfaMs);
  $('#tts-audio').textContent = stats.playedMs != null ? `${(stats.playedMs / 1000).toFixed(2)} s` : '–';
  $('#tts-underruns').textContent = stats.underruns ?? '–';
  $('#tts-rtf').textContent = stats.rtf != null ? stats.rtf.toFixed(3) : '–';
}

async function speak() {
  const text = $('#tts-text').value.trim();
  if (!text) return;
  if (ws) ws.close();
  if (!player) {
    player = await Player.create(PLAYBACK_RATE, stats);
    player.on((m) => {
      if (m.type === 'started') stats.playStartMs = performance.now() - stats.t0;
      if (m.type === 'drained') setStatus('done');
      render();
    });
  }
  for (const k of ['ttfaMs', 'playStartMs', 'serverTtfaMs', 'rtf', 'chunks', 'error']) delete stats[k];
  stats.requests = (stats.requests || 0) + 1;
  const sock = (ws = new WebSocket(wsUrl('v1/tts')));
  const start = { type: 'start', format: 'pcm_s16le', sample_rate: PLAYBACK_RATE, chunk_ms: 40 };
  const speed = parseFloat($('#tts-speed').value);
  if (speed && speed !== 1) start.speed = speed;
  setStatus('connecting…');
  sock.onopen = () => {
    sock.send(JSON.stringify(start));
    stats.t0 = performance.now(); // TTFA: the text leaves -> first audio arrives
    sock.send(JSON.stringify({ type: 'text', text }));
    sock.send(JSON.stringify({ type: 'stop' }));
    player.begin(stats.requests);
    setStatus('speaking…');
  };
  sock.onmessage = (e) => {
    const m = JSON.parse(e.data);
    if (m.type === 'ready') {
      stats.model = m.model;
    } else if (m.type === 'audio') {
      if (stats.ttfaMs == null) stats.ttfaMs = performance.now() - stats.t0;
      stats.chunks = (stats.chunks || 0) + 1;
      player.push(b64ToBuffer(m.audio), stats.requests);
    } else if (m.type === 'done') {
      player.end();
      stats.serverTtfaMs = m.stats.ttfa_ms;
      stats.rtf = m.stats.rtf;
      stats.serverUnderruns = m.stats.underruns;
      stats.serverAudioMs = m.stats.audio_ms;
      stats.done = true;
    } else if (m.type === 'error') {
      stats.error = `${m.code}: ${m.message}`;
      setStatus(`error: ${stats.error}`);
    }
    render();
  };
  sock.onclose = (e) => {
    if (ws === sock) ws = null;
    if (player) player.end();
    if (e.code !== 1000 && !stats.error) setStatus(`closed (${e.code}${e.reason ? ' ' + e.reason : ''})`);
  };
}

async function cancel() {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: 'cancel' }));
  if (player) await player.clear();
  setStatus('cancelled');
}

export function init() {
  $('#tts-speak').addEventListener('click', () => speak().catch((err) => setStatus(`error: ${err.message}`)));
  $('#tts-cancel').addEventListener('click', () => cancel());
  $('#tts-speed').addEventListener('input', (e) => ($('#tts-speed-value').textContent = `${e.target.value}×`));
  setInterval(render, 250);
}
