// Page entry: tabs (kept in the URL hash, the ?token= query untouched) and the model list.

import { $, httpUrl, token } from './common.js';
import * as agent from './agent.js';
import * as tts from './tts.js';
import * as asr from './asr.js';

const TABS = ['agent', 'tts', 'asr'];

function show(name) {
  if (!TABS.includes(name)) name = 'agent';
  for (const t of TABS) {
    $(`#tab-${t}`).hidden = t !== name;
    const b = $(`#nav-${t}`);
    b.classList.toggle('active', t === name);
    b.setAttribute('aria-selected', String(t === name));
  }
}

async function models() {
  try {
    const r = await fetch(httpUrl('v1/models'));
    if (!r.ok) {
      $('#models').textContent = r.status === 401 ? 'unauthorized: add ?token=KEY to the URL' : `models: HTTP ${r.status}`;
      return;
    }
    const { data } = await r.json();
    $('#models').textContent = data.map((m) => `${m.kind || 'tts'}: ${m.id}`).join(' · ');
    window.realtimeStats.models = data;
  } catch (err) {
    $('#models').textContent = `server unreachable (${err.message})`;
  }
}

for (const t of TABS) $(`#nav-${t}`).addEventListener('click', () => (location.hash = t));
window.addEventListener('hashchange', () => show(location.hash.slice(1)));
show(location.hash.slice(1));
agent.init();
tts.init();
asr.init();
models();
if (token) $('#auth').textContent = 'token set';
window.realtimeStats.ready = true;
