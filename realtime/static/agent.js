// Voice agent: microphone -> /v1/realtime (OpenAI Realtime API events as JSON text frames) ->
// live transcripts, the agent's reply text and jitter-buffered reply audio, with barge-in.

import { $, b64ToBuffer, bytesToB64, el, fmtMs, Mic, Player, realtimeStats, showLevel, wsUrl } from './common.js';

const RATE = 24000; // input and output rate of the session
const CHUNK_MS = 40;
const stats = realtimeStats.agent;

let ws = null;
let mic = null;
let player = null;
let sent = []; // [stream ms at the end of the chunk, performance.now() when it was sent]
let sentMs = 0;
let pendingTurn = null; // the user turn whose end of speech was detected, awaiting a response
let cur = null; // the response being received / played
const items = new Map(); // item_id -> {role, node, text}
const itemTags = new Map(); // item_id -> numeric tag for the player
const tagItems = new Map(); // numeric tag -> item_id
const cancelled = new Set(); // response ids whose audio is no longer wanted (barge-in)
let nextTag = 1;

function resetStats() {
  for (const k of Object.keys(stats)) delete stats[k];
  Object.assign(stats, { turns: [], events: {}, bargeIns: 0, truncates: [], errors: [] });
}

function setStatus(text) {
  $('#agent-status').textContent = text;
}

function send(obj) {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(obj));
}

/** When the microphone sample at stream time `ms` was sent (client clock). */
function wallAt(ms) {
  for (const [end, t] of sent) if (end >= ms) return t - (end - ms);
  if (!sent.length) return performance.now();
  const [end, t] = sent[sent.length - 1];
  return t + (ms - end);
}

function bubble(itemId, role) {
  let it = items.get(itemId);
  if (!it) {
    const node = el('div', { class: `msg ${role}` }, el('span', { class: 'who', text: role === 'user' ? 'you' : 'agent' }), el('span', { class: 'text' }));
    $('#agent-log').append(node);
    it = { role, node, text: '' };
    items.set(itemId, it);
  }
  return it;
}

function setText(it, text, partial = false) {
  it.text = text;
  const t = it.node.querySelector('.text');
  t.textContent = text;
  it.node.classList.toggle('partial', partial);
  $('#agent-log').scrollTop = $('#agent-log').scrollHeight;
}

function tagFor(itemId) {
  if (!itemTags.has(itemId)) {
    itemTags.set(itemId, nextTag);
    tagItems.set(nextTag, itemId);
    nextTag++;
  }
  return itemTags.get(itemId);
}

// The server's per-turn metrics (response.realtime_metrics), the ones worth a glance first.
const SHORT = [
  ['turn_latency_ms', 'turn', ' ms'],
  ['asr_final_ms', 'asr', ' ms'],
  ['llm_ttft_ms', 'llm', ' ms'],
  ['tts_ttfa_ms', 'tts', ' ms'],
  ['llm_tokens_per_s', '', ' tok/s'],
  ['underruns', 'underruns', ''],
  ['preemptive_ms', 'started early', ' ms'], // a preemptive reply: how long before the final
];

/** Compact: "turn 512 ms · asr 301 ms · llm 95 ms · tts 60 ms · 31 tok/s · underruns 0 · started early 240 ms". */
function metricsText(t) {
  const m = t.metadata;
  const tail = t.interrupted ? ' · interrupted' : '';
  if (!m || typeof m !== 'object') return t.interrupted ? 'interrupted' : t.status || '';
  let parts = SHORT.filter(([k]) => typeof m[k] === 'number').map(([k, label, unit]) => `${label} ${Math.round(m[k])}${unit}`.trim());
  if (!parts.length) {
    parts = Object.entries(m)
      .filter(([, v]) => typeof v === 'number')
      .map(([k, v]) => `${k} ${Math.round(v)}`);
  }
  return parts.join(' · ') + tail;
}

function renderTurns() {
  const body = $('#agent-turns');
  body.replaceChildren(
    ...stats.turns.map((t, i) =>
      el(
        'tr',
        {},
        el('td', { text: String(i + 1) }),
        el('td', { class: 'clip', text: t.userText || '…' }),
        el('td', { text: fmtMs(t.latencyMs) }),
        el('td', { text: fmtMs(t.firstDeltaMs) }),
        el('td', { text: t.playedMs != null ? `${(t.playedMs / 1000).toFixed(1)} s` : '–' }),
        el('td', { text: String(t.underruns ?? 0) }),
        el('td', { class: 'clip meta', text: metricsText(t) }),
      ),
    ),
  );
  const last = stats.turns[stats.turns.length - 1];
  $('#agent-latency').textContent = fmtMs(last && last.latencyMs);
  $('#agent-underruns').textContent = String(stats.underruns ?? 0);
  $('#agent-played').textContent = stats.playedMs != null ? `${(stats.playedMs / 1000).toFixed(1)} s` : '–';
}

async function bargeIn() {
  const r = cur;
  if (!r) return;
  cur = null;
  cancelled.add(r.id);
  const cleared = await player.clear();
  stats.bargeIns++;
  const itemId = tagItems.get(cleared.item) || r.itemId;
  if (itemId && r.started) {
    const audioEndMs = Math.round(cleared.playedMs);
    send({ type: 'conversation.item.truncate', item_id: itemId, content_index: 0, audio_end_ms: audioEndMs });
    stats.truncates.push({ item_id: itemId, audio_end_ms: audioEndMs });
    const it = items.get(itemId);
    if (it) it.node.classList.add('interrupted');
  }
  r.turn.interrupted = true;
  r.turn.playedMs = cleared.playedMs;
  renderTurns();
}

function onPlayer(m) {
  if (m.type === 'started' && cur && !cur.started) {
    cur.started = true;
    const now = performance.now();
    cur.turn.latencyMs = cur.turn.endWall != null ? now - cur.turn.endWall : null;
    renderTurns();
  } else if (m.type === 'underrun' && cur) {
    cur.turn.underruns = (cur.turn.underruns || 0) + 1;
  } else if (m.type === 'drained' && cur && cur.audioDone) {
    cur.turn.playedMs = m.itemPlayedMs;
    cur = null;
    renderTurns();
  }
}

function onEvent(ev) {
  stats.events[ev.type] = (stats.events[ev.type] || 0) + 1;
  switch (ev.type) {
    case 'session.created':
      stats.session = ev.session && ev.session.id;
      break;
    case 'session.updated':
      stats.sessionUpdated = true;
      setStatus('listening — speak');
      break;
    case 'input_audio_buffer.speech_started':
      $('#agent-vad').classList.add('on');
      if (cur && cur.hasAudio) bargeIn();
      break;
    case 'input_audio_buffer.speech_stopped': {
      $('#agent-vad').classList.remove('on');
      const endMs = ev.audio_end_ms ?? sentMs - Number($('#agent-silence').value);
      pendingTurn = { userItem: ev.item_id, endMs, endWall: wallAt(endMs), underruns: 0 };
      stats.turns.push(pendingTurn);
      if (ev.item_id) bubble(ev.item_id, 'user');
      renderTurns();
      break;
    }
    case 'input_audio_buffer.committed':
      if (ev.item_id) bubble(ev.item_id, 'user');
      break;
    case 'conversation.item.input_audio_transcription.delta': {
      const it = bubble(ev.item_id, 'user');
      setText(it, it.text + (ev.delta || ''), true);
      break;
    }
    case 'conversation.item.input_audio_transcription.completed': {
      const it = bubble(ev.item_id, 'user');
      setText(it, ev.transcript || '');
      const turn = stats.turns.find((t) => t.userItem === ev.item_id) || pendingTurn;
      if (turn) turn.userText = ev.transcript;
      stats.lastTranscript = ev.transcript;
      renderTurns();
      break;
    }
    case 'response.created': {
      const turn = pendingTurn || { underruns: 0 };
      if (!pendingTurn) stats.turns.push(turn);
      pendingTurn = null;
      turn.responseId = ev.response && ev.response.id;
      cur = { id: turn.responseId, turn, started: false, hasAudio: false, audioDone: false, t0: performance.now() };
      turn.underruns = 0;
      break;
    }
    case 'response.output_audio.delta': {
      if (cancelled.has(ev.response_id)) break;
      if (!cur) break; // audio of a response we never saw created, or already cut off
      if (!cur.hasAudio) {
        cur.hasAudio = true;
        cur.itemId = ev.item_id;
        cur.turn.firstDeltaMs = cur.turn.endWall != null ? performance.now() - cur.turn.endWall : null;
        player.begin(tagFor(ev.item_id));
      }
      player.push(b64ToBuffer(ev.delta), tagFor(ev.item_id));
      break;
    }
    case 'response.output_audio.done':
      if (cur && !cancelled.has(ev.response_id)) {
        cur.audioDone = true;
        player.end();
      }
      break;
    case 'response.output_audio_transcript.delta': {
      if (cancelled.has(ev.response_id) && !items.has(ev.item_id)) break;
      const it = bubble(ev.item_id, 'agent');
      setText(it, it.text + (ev.delta || ''), true);
      break;
    }
    case 'response.output_audio_transcript.done': {
      const it = bubble(ev.item_id, 'agent');
      if (!it.node.classList.contains('interrupted')) setText(it, ev.transcript ?? it.text);
      else it.node.classList.remove('partial');
      stats.lastReply = ev.transcript ?? it.text;
      break;
    }
    case 'response.done': {
      const resp = ev.response || {};
      const turn = stats.turns.find((t) => t.responseId === resp.id);
      if (turn) {
        turn.status = resp.status;
        // our server's per-turn metrics (realtime_metrics); OpenAI's own field for extras is metadata
        turn.metadata = resp.realtime_metrics ?? resp.metadata ?? null;
      }
      if (cur && cur.id === resp.id) {
        cur.audioDone = true;
        player.end();
        if (!cur.hasAudio) cur = null;
      }
      stats.responsesDone = (stats.responsesDone || 0) + 1;
      renderTurns();
      break;
    }
    case 'error': {
      const e = ev.error || {};
      const text = `${e.code || e.type || 'error'}: ${e.message || ''}`;
      stats.errors.push(text);
      setStatus(`error: ${text}`);
      break;
    }
    default:
      break;
  }
}

function sessionUpdate() {
  const session = {
    type: 'realtime',
    audio: {
      input: {
        format: { type: 'audio/pcm', rate: RATE },
        turn_detection: {
          type: 'server_vad',
          threshold: Number($('#agent-threshold').value),
          prefix_padding_ms: Number($('#agent-prefix').value),
          silence_duration_ms: Number($('#agent-silence').value),
          interrupt_response: true,
        },
      },
      output: { format: { type: 'audio/pcm', rate: RATE } },
    },
  };
  const instructions = $('#agent-instructions').value.trim();
  if (instructions) session.instructions = instructions;
  return { type: 'session.update', session };
}

async function start() {
  $('#agent-talk').textContent = 'Stop';
  $('#agent-talk').classList.add('live');
  resetStats();
  sent = [];
  sentMs = 0;
  cur = null;
  pendingTurn = null;
  if (!player) {
    player = await Player.create(RATE, stats);
    player.on(onPlayer);
  }
  const sock = (ws = new WebSocket(wsUrl('v1/realtime')));
  const early = [];
  const append = (pcm) => {
    sock.send(JSON.stringify({ type: 'input_audio_buffer.append', audio: bytesToB64(pcm) }));
    sentMs += (pcm.byteLength / 2 / RATE) * 1000;
    sent.push([sentMs, performance.now()]);
    if (sent.length > 3000) sent = sent.slice(-1500);
    stats.sentMs = sentMs;
  };
  setStatus('connecting…');
  sock.onopen = () => {
    sock.send(JSON.stringify(sessionUpdate()));
    for (const p of early.splice(0)) append(p);
  };
  sock.onmessage = (e) => {
    let ev;
    try {
      ev = JSON.parse(e.data);
    } catch {
      return;
    }
    onEvent(ev);
  };
  sock.onclose = (e) => {
    if (ws === sock) ws = null;
    stopMic();
    stats.closed = e.code;
    if (e.code !== 1000) setStatus(`closed (${e.code}${e.reason ? ' ' + e.reason : ''})`);
    else setStatus('stopped');
    $('#agent-talk').textContent = 'Talk';
    $('#agent-talk').classList.remove('live');
  };
  try {
    mic = await Mic.open({
      rate: RATE,
      chunkMs: CHUNK_MS,
      // echo cancellation: through speakers the agent's own voice must not trigger barge-in
      processing: $('#agent-aec').checked,
      onChunk: (pcm, level) => {
        showLevel($('#agent-level'), level);
        if (sock.readyState === WebSocket.CONNECTING) {
          early.push(pcm); // the microphone can open before the socket: keep its first words
          return;
        }
        if (sock.readyState !== WebSocket.OPEN) return;
        for (const p of early.splice(0)) append(p);
        append(pcm);
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
  showLevel($('#agent-level'), 0);
}

function stop() {
  stopMic();
  if (ws) ws.close(1000, 'bye');
  if (player) player.clear();
  cur = null;
}

export function init() {
  resetStats();
  $('#agent-talk').addEventListener('click', () => {
    if (ws) stop();
    else start().catch((err) => setStatus(`error: ${err.message}`));
  });
  setInterval(renderTurns, 500);
}
